"""Per-tenant stores (``--api-keys``): each tenant has its own image store, data-URL
memo, video store, file store and batch manager, so nothing one tenant uploads, lists,
deletes or runs is visible to another (another tenant's id answers 404; listings show
only one's own).

Ids stay content-addressed (``img-`` + the image key), but per tenant: the same bytes
uploaded by two tenants are two entries, each with its own ``created`` time and its own
LRU place, and an upload of bytes another tenant holds decodes as a first upload does
(no memo across tenants), so neither the answer nor its timing tells one tenant that
another uploaded them. Bounds (``--max-stored-images`` and the others) apply per tenant.
The ``default`` tenant (one key, or none) keeps the server's own stores and directories;
another tenant's files live under ``tenants/<name>/`` of the same directories.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, Generic, TypeVar

from api.tenants import CURRENT_TENANT, DEFAULT_TENANT, current_tenant

T = TypeVar("T")


class PerTenant(Generic[T]):
    """Stands for the current tenant's instance of a store: attribute access (and
    ``len``) goes to :meth:`of` ``(current_tenant())``.

    Args:
        default: the ``default`` tenant's instance (the server's own).
        make: builds another tenant's instance on first use (called under a lock).
        on_new: called with ``(tenant, instance)`` after one is made, with that tenant
            as :data:`~api.tenants.CURRENT_TENANT` (a batch manager starts there, so its
            tasks run as that tenant).
    """

    def __init__(
        self,
        default: T,
        make: Callable[[str], T],
        on_new: Callable[[str, T], None] | None = None,
    ) -> None:
        self._pt_items: dict[str, T] = {DEFAULT_TENANT: default}
        self._pt_make = make
        self._pt_on_new = on_new
        self._pt_lock = threading.Lock()

    def of(self, tenant: str) -> T:
        """``tenant``'s instance (made on first use)."""
        item = self._pt_items.get(tenant)
        if item is not None:
            return item
        with self._pt_lock:
            item = self._pt_items.get(tenant)
            if item is None:
                item = self._pt_items[tenant] = self._pt_make(tenant)
                if self._pt_on_new is not None:
                    token = CURRENT_TENANT.set(tenant)
                    try:
                        self._pt_on_new(tenant, item)
                    finally:
                        CURRENT_TENANT.reset(token)
        return item

    def items(self) -> list[tuple[str, T]]:
        """Every tenant's instance made so far."""
        return list(self._pt_items.items())

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_pt_"):
            raise AttributeError(name)
        return getattr(self.of(current_tenant()), name)

    def __len__(self) -> int:
        return len(self.of(current_tenant()))  # type: ignore[arg-type]


def tenant_dir(root: str | Path | None, tenant: str) -> Path | None:
    """``root/tenants/<tenant>`` (None when ``root`` is None)."""
    return None if root is None else Path(root) / "tenants" / tenant


class TenantBatches(PerTenant[Any]):
    """Per-tenant batch managers: :meth:`start` starts every known tenant's (so a
    tenant's unfinished batches resume at start-up), one made later starts at once."""

    def __init__(self, default: Any, make: Callable[[str], Any], tenants: list[str]) -> None:
        self._pt_started = False
        super().__init__(default, make, self._started)
        self._pt_tenants = tenants

    def _started(self, _tenant: str, manager: Any) -> None:
        if self._pt_started:
            manager.start()

    def start(self) -> None:
        """Start each tenant's manager, as that tenant (its tasks inherit it)."""
        for tenant, manager in self.items():  # those made so far
            token = CURRENT_TENANT.set(tenant)
            try:
                manager.start()
            finally:
                CURRENT_TENANT.reset(token)
        self._pt_started = True
        for tenant in self._pt_tenants:
            self.of(tenant)  # made now: started as that tenant (on_new)

    async def stop(self) -> None:
        """Stop every tenant's manager."""
        for _, manager in self.items():
            with contextlib.suppress(Exception):
                await manager.stop()


def split_by_tenant(state: Any, tenants: list[str]) -> None:
    """Give every tenant its own stores in ``state`` (a :class:`~api.state.ServerState`
    whose stores and batch manager are built): ``state.store``, ``state.media.store``,
    ``state.media.transient``, ``state.videos``, ``state.thumbnails`` and
    ``state.batches`` become
    :class:`PerTenant` stand-ins whose ``default`` instances are the built ones.

    Args:
        tenants: the tenants of the ``--api-keys`` file (their batch managers start, and
            resume their batches, with the server).
    """
    from api.batch.runner import BatchManager
    from api.batch.store import FileStore
    from api.image_store import ImageStore
    from api.thumbnails import Thumbnails
    from api.video_store import VideoStore

    settings = state.settings
    images = state.store

    def image_store(tenant: str) -> ImageStore:
        return ImageStore(
            images.prepare,
            max_images=settings.max_stored_images,
            max_bytes=settings.max_stored_image_bytes,
            directory=tenant_dir(settings.image_store_dir, tenant),
        )

    transient = state.media.transient
    stores: PerTenant[ImageStore] = PerTenant(images, image_store)
    state.store = stores
    state.media.store = stores
    state.media.transient = PerTenant(
        transient,
        lambda _t: ImageStore(images.prepare, max_images=transient.max_images, keep_files=False),
    )
    state.videos = PerTenant(
        state.videos,
        lambda _t: VideoStore(settings.max_stored_videos, settings.max_stored_video_bytes),
    )
    # a thumbnail made for one tenant is not served faster to another
    state.thumbnails = PerTenant(state.thumbnails, lambda _t: Thumbnails())
    batches = state.batches

    def manager(tenant: str) -> BatchManager:
        root = tenant_dir(settings.resolved_data_dir(), tenant)
        assert root is not None
        return BatchManager(
            state, FileStore(root, settings.max_stored_file_bytes), getattr(batches, "_ready", None)
        )

    state.batches = TenantBatches(batches, manager, tenants)
