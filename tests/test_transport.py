"""The data plane's wire contract over a real UCX endpoint on loopback."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
from typing import Any

import numpy as np
import pytest

from hoplite_gpu import protocol as p
from hoplite_gpu.dataplane.ucx.loading import ucxx_module

pytestmark = pytest.mark.timeout(60)

CHUNK = 256 << 10
SOURCE = np.repeat(np.array([1, 2], np.uint8), CHUNK)  # two chunks that differ in every byte


def _exchange(conn: Any) -> None:
    """In a process of its own (ucxx's context binds to the first event loop that uses it, and
    the test process's nodes run theirs on another): send the chunks out of order to a listener
    in this process, post the receives in order, and send back what landed."""
    ucxx = ucxx_module()
    transfer = 42

    async def main() -> np.ndarray[Any, Any]:
        sent: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        async def serve(ep: Any) -> None:
            try:
                await ep.send(SOURCE[: CHUNK // 2], tag=p.chunk_tag(transfer, 0, CHUNK // 2))
                await ep.send(SOURCE[CHUNK:], tag=p.chunk_tag(transfer, CHUNK, 2 * CHUNK))
                await ep.send(SOURCE[:CHUNK], tag=p.chunk_tag(transfer, 0, CHUNK))
                sent.set_result(None)
            except BaseException as exc:
                sent.set_exception(exc)

        listener = ucxx.create_listener(serve, port=0)
        ep = await ucxx.create_endpoint("127.0.0.1", listener.port)
        try:
            dest = np.zeros(2 * CHUNK, np.uint8)
            await asyncio.wait_for(
                asyncio.gather(
                    ep.recv(dest[:CHUNK], tag=p.chunk_tag(transfer, 0, CHUNK)),
                    ep.recv(dest[CHUNK:], tag=p.chunk_tag(transfer, CHUNK, 2 * CHUNK)),
                ),
                30,
            )
            await asyncio.wait_for(sent, 30)
            return dest
        finally:
            ep.abort()
            listener.close()

    try:
        conn.send(("ok", asyncio.run(main())))
    except BaseException as exc:
        conn.send(("error", repr(exc)))


def test_a_chunk_lands_only_in_the_receive_posted_for_its_bytes() -> None:
    """Chunks sent out of order, and a shorter chunk (a sender cut at an injected fault), still
    land at their own offsets: a receive is matched by the bytes it asks for, not by the order of
    the messages (ucxx hands a queued message to whichever receive of its tag asks first, see
    protocol.chunk_tag)."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_exchange, args=(child,), daemon=True)
    proc.start()
    try:
        assert parent.poll(45), "the exchange did not finish"
        status, dest = parent.recv()
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
    assert status == "ok", dest
    assert np.array_equal(dest, SOURCE)


def test_chunk_tags_name_the_transfer_and_the_bytes() -> None:
    tags = {
        p.chunk_tag(t, start, end)
        for t in (1, 2)
        for start, end in ((0, CHUNK), (CHUNK, 2 * CHUNK), (0, CHUNK // 2))
    }
    assert len(tags) == 6


def test_ucx_cuda_adds_cuda_copy_to_the_transports_a_process_inherited(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With HOPLITE_UCX_CUDA=1, UCX_TLS lists cuda_copy even where a parent node set it to its default
    (ucxx refuses device buffers otherwise: found on an H100); lists that cover it stay as they are."""
    from hoplite_gpu.dataplane.ucx import settings

    monkeypatch.setenv(settings.UCX_CUDA_ENV, "1")
    for before, after in [
        ("tcp", "tcp,cuda_copy"),
        ("tcp,sm", "tcp,sm,cuda_copy"),
        ("tcp,cuda_copy", "tcp,cuda_copy"),
        ("all", "all"),
        ("^sm", "^sm"),
    ]:
        monkeypatch.setenv("UCX_TLS", before)
        settings.apply_ucx_defaults()
        assert settings.os.environ["UCX_TLS"] == after
    monkeypatch.delenv("UCX_TLS")
    settings.apply_ucx_defaults()
    assert settings.os.environ["UCX_TLS"] == settings.default_ucx_tls() == "tcp,cuda_copy"
    monkeypatch.setenv(settings.UCX_CUDA_ENV, "0")
    monkeypatch.setenv("UCX_TLS", "tcp")
    settings.apply_ucx_defaults()
    assert settings.os.environ["UCX_TLS"] == "tcp" and settings.default_ucx_tls() == "tcp"
