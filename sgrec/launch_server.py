"""`python -m sgrec.launch_server`: starts the scheduler processes, then serves HTTP.

If a scheduler process dies, /health turns 503, requests in flight get a 500 within a second and
the launcher exits non-zero. SIGINT/SIGTERM shut everything down with no orphan processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import multiprocessing as mp
import os
import shutil
import signal
import sys
import tempfile
import time

from sgrec.server_args import ServerArgs, cache_dir

logger = logging.getLogger("sgrec.launch_server")

READY_TIMEOUT_S = 900.0
WATCH_INTERVAL_S = 0.2


def ensure_default_model() -> str:
    """The embedded default model: the packaged MovieLens-100K demo recommender (sgrec.demo), or a
    generated tiny random Llama when the demo artifacts are missing (a source tree before
    `python -m sgrec.demo.train`)."""
    from sgrec import demo

    if demo.available():
        return demo.model_path()
    path = os.path.join(cache_dir(), "default-tiny-llama")
    if not os.path.exists(os.path.join(path, "config.json")):
        from sgrec.tools.make_tiny_model import make_tiny_model

        tmp = tempfile.mkdtemp(prefix="default-tiny-", dir=os.path.dirname(path) if os.path.isdir(os.path.dirname(path)) else None)
        make_tiny_model(tmp, arch="llama", seed=0)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if not os.path.exists(path):
            os.replace(tmp, path)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    return path


def _model_facts(path: str) -> dict:
    from sgrec.model.config import ModelConfig

    cfg = ModelConfig.from_dir(path)
    return {"model_type": cfg.hf_config.get("model_type"), "architectures": cfg.hf_config.get("architectures")}


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn re-raises a captured SIGTERM after shutdown; sgrec handles signals itself."""

        @contextlib.contextmanager
        def capture_signals(self):
            yield

    return Server


SERVER_HEADER = b"x-sgrec-server"


def _tag_responses(app, server: str):
    """Every response names the server that answered (`X-Sgrec-Server: host:port`), so that behind
    a load balancer a client or a test can tell which one served it. Plain ASGI: streams stay streams."""
    value = server.encode()

    async def tagged(scope, receive, send):
        if scope["type"] != "http":
            return await app(scope, receive, send)

        async def send_tagged(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (SERVER_HEADER, value)]}
            await send(message)

        return await app(scope, receive, send_tagged)

    return tagged


async def serve(args: ServerArgs, in_addrs: list[str], out_addr: str, launch: dict) -> int:
    import uvicorn

    from sgrec.entrypoints.http_server import create_app
    from sgrec.managers.metrics import Metrics
    from sgrec.managers.tokenizer_manager import TokenizerManager
    from sgrec.scheduler.process import run_scheduler_process

    _Server = _server_class()

    tm = TokenizerManager(args, in_addrs, out_addr)
    # one item-KV endpoint per rank (ipc): with HRCS a rank fetches cold items it does not own from their owner
    item_addrs = [a.replace("/scheduler-", "/items-") for a in in_addrs]
    ctx = mp.get_context("spawn")
    if args.dp_size > 1 and args.item_catalog:  # one copy of the catalog for the ranks (sgrec.catalog.image)
        from sgrec.catalog import image

        launch["catalog_image"] = os.environ[image.ENV] = image.folder_for(args.item_catalog)
    procs = [
        ctx.Process(target=run_scheduler_process, args=(args.to_dict(), r, in_addrs[r], out_addr, item_addrs),
                    name=f"sgrec-scheduler-{r}", daemon=True)
        for r in range(args.dp_size)
    ]
    launch["procs"] = procs
    for p in procs:
        p.start()

    def dead_child() -> str | None:
        for r, p in enumerate(procs):
            if not p.is_alive():
                return f"Scheduler process DP{r} died (exit code {p.exitcode})"
        return None

    logger.info("loading the model in %d scheduler process(es) ...", len(procs))
    try:
        await tm.wait_ready(READY_TIMEOUT_S, dead_child)
    except RuntimeError as e:
        logger.error("start-up failed: %s", e)
        return 1
    if args.enable_metrics:
        tm.metrics = Metrics(args.served_model_name)
    app = _tag_responses(create_app(tm, args, launch), f"{args.host}:{args.port}")
    gc.collect()
    gc.freeze()  # start-up's objects out of the cyclic GC's scans (see sgrec.scheduler.process.freeze_startup_objects)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            access_log=args.log_level == "debug", timeout_graceful_shutdown=5,
                            timeout_keep_alive=args.timeout_keep_alive)
    server = _Server(config)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, lambda: setattr(server, "should_exit", True))
    exit_code = 0

    async def watch() -> None:
        nonlocal exit_code
        while not server.started and not server.should_exit:
            await asyncio.sleep(WATCH_INTERVAL_S)
        if server.started:
            logger.info("sgrec server ready at http://%s:%d (model %s, dp_size %d, KV pool %d tokens)",
                        args.host, args.port, args.model_path, args.dp_size, tm.max_total_num_tokens)
        while not server.should_exit:
            await asyncio.sleep(WATCH_INTERVAL_S)
            if (err := dead_child()) is not None:
                logger.error("%s; failing requests in flight and shutting down", err)
                tm.fail_all(err, 500)
                exit_code = 1
                await asyncio.sleep(1.0)  # let the 5xx answers go out
                server.should_exit = True

    watcher = asyncio.create_task(watch())
    await server.serve()
    watcher.cancel()
    if not server.started and exit_code == 0:
        exit_code = 1  # e.g. the port was taken
    return exit_code


def main(argv: list[str] | None = None) -> int:
    args = ServerArgs.from_cli(argv)
    logging.basicConfig(level=args.log_level.upper(), format="[%(asctime)s] %(message)s")
    from sgrec import demo

    if args.model_path is None:
        args.model_path = ensure_default_model()
        logger.info("no --model-path: serving the embedded default model at %s", args.model_path)
    args.model_path = demo.resolve(args.model_path)  # `demo`, `demo-tiger`: the packaged demos
    if args.item_catalog is None and (catalog := demo.packaged_catalog(args.model_path)) is not None:
        args.item_catalog = catalog
        logger.info("serving the packaged demo at %s with its item catalog %s", args.model_path, catalog)
    try:
        facts = _model_facts(args.model_path)
    except (OSError, ValueError, KeyError) as e:
        print(f"error: cannot load a model from {args.model_path!r}: {e}", file=sys.stderr)
        return 2
    if args.served_model_name is None:
        args.served_model_name = args.model_path
    if args.item_catalog:  # a crash mid-compaction or mid-append: settled before anyone replays or appends
        from sgrec.catalog import CatalogError, compact, journal

        try:
            for warning in (compact.finish(args.item_catalog, args.journal_path), journal.repair(args.journal_path)):
                if warning is not None:
                    logger.warning("%s", warning)
        except CatalogError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    ipc_dir = tempfile.mkdtemp(prefix="sgrec-ipc-")
    in_addrs = [f"ipc://{ipc_dir}/scheduler-{r}" for r in range(args.dp_size)]
    out_addr = f"ipc://{ipc_dir}/tokenizer"
    launch = {"launch_command": " ".join([sys.executable, "-m", "sgrec.launch_server", *(argv or sys.argv[1:])]),
              "startup_time": time.time(), **facts}
    try:
        return asyncio.run(serve(args, in_addrs, out_addr, launch))
    except KeyboardInterrupt:
        return 0
    finally:
        for p in launch.get("procs", []):
            if p.is_alive():
                p.terminate()
        for p in launch.get("procs", []):
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(1)
        shutil.rmtree(ipc_dir, ignore_errors=True)
        if launch.get("catalog_image"):
            shutil.rmtree(launch["catalog_image"], ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
