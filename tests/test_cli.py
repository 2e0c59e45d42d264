"""``mmserve serve``'s command line: every setting a flag with its default, typed settings."""

from __future__ import annotations

import dataclasses

import pytest

from api.cli import LaunchSettings, build_parser, main, settings_from_args
from api.settings import ServerSettings
from mmserve.config import EngineConfig
from mmserve.vision.image import ImageLimits
from tests.helpers import ANY_PORT, serve_help_defaults


def test_flags_parse_into_typed_settings() -> None:
    args = build_parser().parse_args(
        [
            "serve",
            "--attention-backend",
            "flashinfer",
            "--dtype",
            "float16",
            "--page-size",
            "16",
            "--disable-radix-cache",
            "--max-image-side",
            "4000",
            "--max-n",
            "4",
            "--shutdown-grace-seconds",
            "2.5",
            "--port",
            "9",
        ]
    )
    launch, engine, server = settings_from_args(args)
    assert (engine.attention_backend, engine.dtype, engine.page_size) == (
        "flashinfer",
        "float16",
        16,
    )
    assert engine.disable_radix_cache is True
    assert engine.image_limits == ImageLimits(max_side=4000)
    assert server == ServerSettings(max_n=4)
    assert launch == LaunchSettings(port=9, shutdown_grace_seconds=2.5)
    # no flags: every dataclass default, defined once
    launch, engine, server = settings_from_args(build_parser().parse_args(["serve"]))
    assert (launch, engine, server) == (LaunchSettings(), EngineConfig(), ServerSettings())
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--attention-backend", "nope"])


def test_every_setting_is_a_flag_and_help_shows_its_default() -> None:
    shown = serve_help_defaults()
    renamed = {"model_path": "model"}
    flags = []
    for cls, skip in [
        (LaunchSettings, ()),
        (EngineConfig, ("image_limits",)),
        (ImageLimits, ()),
        (ServerSettings, ()),
    ]:
        for f in dataclasses.fields(cls):
            if f.name in skip:
                continue
            name = renamed.get(f.name, f.name)
            if cls is ImageLimits:
                name = "max_image_" + name.removeprefix("max_")
            flag = "--" + name.replace("_", "-")
            assert shown.get(flag) == str(getattr(cls(), f.name)), (flag, shown.get(flag))
            flags.append(flag)
    assert len(flags) == len(set(flags)) > 60  # no two settings share a flag


def test_bad_setting_is_a_clear_error(capsys) -> None:
    assert main(["serve", "--page-size", "0"]) == 2
    assert "page_size must be >= 1" in capsys.readouterr().err


def test_cli_serve_flashinfer_on_cpu_fails_fast(model_dir, capsys) -> None:
    rc = main(["serve", *ANY_PORT, "--model", str(model_dir), "--attention-backend", "flashinfer"])
    err = capsys.readouterr().err
    assert rc == 2 and "CUDA" in err and "--attention-backend torch" in err


def test_no_settings_travel_through_the_environment() -> None:
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    for path in [*root.glob("api/*.py"), *root.glob("mmserve/**/*.py")]:
        assert "MMSERVE_SERVER_CONFIG" not in path.read_text(), path
    assert not (root / "mmserve" / "server_flags.py").exists()


def test_data_dir_flag_and_its_default(monkeypatch, tmp_path) -> None:
    _, _, server = settings_from_args(
        build_parser().parse_args(["serve", "--data-dir", str(tmp_path / "d")])
    )
    assert server.data_dir == str(tmp_path / "d")
    assert server.resolved_data_dir() == tmp_path / "d"
    # no flag: $MMSERVE_CACHE_DIR, then $XDG_CACHE_HOME/mmserve, then ~/.cache/mmserve
    monkeypatch.setenv("MMSERVE_CACHE_DIR", str(tmp_path / "m"))
    assert ServerSettings().resolved_data_dir() == tmp_path / "m" / "batches"
    monkeypatch.delenv("MMSERVE_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert ServerSettings().resolved_data_dir() == tmp_path / "x" / "mmserve" / "batches"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "h"))
    assert ServerSettings().resolved_data_dir() == tmp_path / "h" / ".cache" / "mmserve" / "batches"
    with pytest.raises(SystemExit):  # the old name is gone
        build_parser().parse_args(["serve", "--batch-dir", str(tmp_path)])


def test_cli_serve_kv_budget_too_small_is_refused_with_numbers(model_dir, capsys) -> None:
    rc = main(["serve", *ANY_PORT, "--model", str(model_dir), "--kv-cache-memory", "100000"])
    err = capsys.readouterr().err
    assert rc == 2 and "mmserve serve: error: the KV pool would hold" in err
    assert "bytes per token" in err and "Traceback" not in err
    assert main(["serve", "--kv-cache-memory", "1", "--mem-fraction-static", "0.5"]) == 2
    assert "not both" in capsys.readouterr().err


def test_make_model_help_shows_each_default_once() -> None:
    import argparse

    from mmserve.cli import add_make_model_parser

    sub = argparse.ArgumentParser().add_subparsers()
    text = " ".join(add_make_model_parser(sub).format_help().split())
    assert "(default: None)" not in text
    assert "(default: tiny)" in text and "(default: 0)" in text  # --size, --seed
    assert "(default: llava, or the family of a real --size)" in text


def test_help_is_grouped_by_subject_in_plain_text() -> None:
    from api.cli import SUBJECTS

    text = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()
    titles = [
        line[:-1] for line in text.splitlines() if line and line[0] != " " and line[-1] == ":"
    ]
    assert titles == ["options"] + [title for title, _ in SUBJECTS]  # no "other" section
    section = text[text.index("\nKV cache & tiers:") : text.index("\nscheduling:")]
    assert "--kv-host-bytes" in section and "--max-running-requests" not in section
    for markup in ("``", ":class:", ":func:", ":mod:", ":data:", ":meth:"):
        assert markup not in text, markup


def test_help_names_values_and_flags_not_code() -> None:
    import re

    from mmserve.config import DEFAULT_MAX_TOTAL_TOKENS

    text = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()
    flat = " ".join(text.split())
    # no module constant (POLICIES, DEFAULT_MAX_TOTAL_TOKENS...): only environment variables
    caps = set(re.findall(r"\b[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)+\b", text))
    assert caps == {
        "MMSERVE_API_KEY",
        "MMSERVE_CACHE_DIR",
        "XDG_CACHE_HOME",
        "HF_HOME",
        "HF_HUB_CACHE",
    }, caps
    assert f"else {DEFAULT_MAX_TOTAL_TOKENS} tokens" in flat  # the number, not its name
    assert "sized from --kv-cache-memory or --mem-fraction-static" in flat
    assert "EngineRequest" not in text and "Engine " not in text and "None:" not in text
    assert "--policy {lpm,dfs-weight,fcfs,random}" in flat  # choices listed
    # boolean flags off by default: only the positive form, no double negative
    assert "--no-disable-" not in text and "--no-" not in text
    assert "  --disable-radix-cache\n" in text  # one spelling, help on the next line
    # ...but every spelling still parses
    args = build_parser().parse_args(["serve", "--disable-radix-cache", "--no-disable-radix-cache"])
    assert settings_from_args(args)[1].disable_radix_cache is False


def test_serve_typo_gets_serve_usage_and_a_suggestion(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--prot", "8001"])
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert err.startswith("usage: mmserve serve ") and "{serve,make-model}" not in err
    assert "mmserve serve: error: unrecognized arguments: --prot 8001" in err
    assert "(did you mean --port?)" in err


def test_busy_port_is_refused_before_the_model_loads(monkeypatch, capsys) -> None:
    import socket

    from mmserve.frontend import frontend as engine_module

    def no_engine(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(engine_module, "Engine", no_engine)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"port {port} on 127.0.0.1 is in use" in err and "--port" in err


def test_startup_summary_names_model_pool_backend_tiers_and_url(loaded, tmp_path) -> None:
    from api.startup import startup_summary
    from mmserve.frontend.frontend import Engine

    config = EngineConfig(
        dtype="float32", max_total_tokens=4096, page_size=4, kv_host_bytes=1 << 20
    )
    engine = Engine(config, model=loaded)
    launch = LaunchSettings(port=8123)
    model, pool, backend, tiers, url = startup_summary(engine, launch, ServerSettings())
    params = sum(p.numel() for p in loaded.decoder.parameters()) + sum(
        p.numel() for p in loaded.vision.parameters()
    )
    assert f"{loaded.family.name} family, {params / 1e6:,.1f} M parameters" in model
    assert "dtype float32 (--dtype)" in model
    assert "1,024 pages x 4 tokens = 4,096 tokens" in pool and "MiB of float32" in pool
    assert "--max-total-tokens" in pool
    assert "attention backend: torch; decode: eager (no CUDA device)" == backend
    assert "host memory" in tiers and "disk" not in tiers
    assert "http://127.0.0.1:8123/v1" in url


def test_serve_logs_its_choices_by_default(model_dir, tmp_path) -> None:
    from tests.live_server import live_server_process

    log = tmp_path / "serve.log"
    with live_server_process(model_dir, "--page-size", "4", log_path=log) as (url, _):
        text = log.read_text()
    port = url.rsplit(":", 1)[1]
    startup = text[: text.index("Application startup complete")]
    lines = [line for line in startup.splitlines() if line.startswith("INFO:")]
    assert any("llava family" in x and "dtype float32 (--dtype)" in x for x in lines), text
    assert any("pages x 4 tokens = 32,768 tokens" in x and "sized by" in x for x in lines)
    assert any(
        x.endswith("attention backend: torch; decode: eager (no CUDA device)") for x in lines
    )
    assert any("KV tiers: the pool only" in x for x in lines)
    assert any(f"at http://127.0.0.1:{port}/v1" in x for x in lines)
