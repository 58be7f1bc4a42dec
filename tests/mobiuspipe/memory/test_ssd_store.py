"""The SSD store: round trips, the atomic index, checksums, and faults (full disk, failed write, truncated,
corrupted or missing file, damaged index, a folder that refuses O_DIRECT, a second process)."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from mobiuspipe import _ext
from mobiuspipe.errors import SwapIOError
from mobiuspipe.memory.store import ssd_store
from mobiuspipe.memory.store.ssd_store import SSDStore

BACKENDS = [
    pytest.param(b, marks=pytest.mark.skipif(not _ext.HAVE_C, reason="C++ extension not built"))
    for b in ("uring", "threads")
] + ["python"]


def _tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "scalar": torch.tensor(3.25),
        "empty": torch.empty(0, 5),
        "w/odd": torch.randn(7, 13, generator=g),
        "bf16": torch.randn(4097, generator=g).bfloat16(),
        "fp16": torch.randn(3, 1023, generator=g).half(),
        "i64": torch.randint(-(2**40), 2**40, (1001,), generator=g),
        "big": torch.randn((1 << 20) + 3, generator=g),
    }


def _store(path, backend="threads", **kw) -> SSDStore:
    try:
        return SSDStore(path, backend=backend, queue_depth=8, block_bytes=1 << 16, **kw)
    except SwapIOError:
        raise
    except RuntimeError as exc:  # io_uring refused in this sandbox
        pytest.skip(str(exc))


@pytest.mark.parametrize("backend", BACKENDS)
def test_put_get_round_trips_and_survive_a_reopen(tmp_path, backend):
    data = _tensors()
    with _store(tmp_path / "job", backend) as store:
        assert store.direct == (backend != "python")
        for k, t in data.items():
            store.put(k, t)
        for k, t in data.items():
            back = store.get(k)
            assert back.dtype == t.dtype and back.shape == t.shape and torch.equal(back, t), k
    with _store(tmp_path / "job", backend) as store:
        assert store.keys() == sorted(data) and len(store) == len(data)
        for k, t in data.items():
            assert torch.equal(store.get(k), t)
        assert store.info("big").nbytes == ((1 << 20) + 3) * 4


def test_async_puts_and_gets_into_given_buffers(tmp_path):
    data = {f"t{i}": torch.randn(10_000 + 777 * i) for i in range(8)}
    with _store(tmp_path / "job") as store:
        futures = [store.put_async(k, t) for k, t in data.items()]
        assert all(f.result() is None for f in futures)
        outs = {k: torch.empty_like(t) for k, t in data.items()}
        futures = {k: store.get_async(k, out=outs[k]) for k in data}
        for k, f in futures.items():
            assert f.result() is outs[k] and torch.equal(outs[k], data[k])
        with pytest.raises(ValueError, match="out for tensor 't0' must be .* float32 tensor of 40000 bytes"):
            store.get("t0", out=torch.empty(10, dtype=torch.float64))


def test_overwrite_delete_and_ordering_on_one_key(tmp_path):
    with _store(tmp_path / "job") as store:
        store.put("k", torch.ones(100_000))
        f1 = store.put_async("k", torch.full((10,), 2.0))  # smaller: same file, new size
        f2 = store.get_async("k")  # waits for the write before it
        assert torch.equal(f2.result(), torch.full((10,), 2.0)) and f1.done()
        store.put("k", torch.arange(300_000.0))  # larger: the file grows
        assert torch.equal(store.get("k"), torch.arange(300_000.0))
        name = store.info("k").file
        store.delete("k")
        assert "k" not in store and not (tmp_path / "job" / name).exists()
        with pytest.raises(KeyError, match="no tensor 'k'"):
            store.get("k")


def test_index_is_written_atomically_and_only_on_flush(tmp_path):
    folder = tmp_path / "job"
    store = _store(folder)
    store.put("a", torch.ones(3))
    assert not (folder / "index.json").exists()  # nothing durable until flush
    store.meta["opt"] = {"step": 7}
    store.flush()
    doc = json.loads((folder / "index.json").read_text())
    assert doc["format"] == "mobiuspipe-ssd-store" and doc["meta"] == {"opt": {"step": 7}}
    assert not [p for p in os.listdir(folder) if ".tmp" in p]
    store.close()


def test_a_damaged_index_is_a_clear_error(tmp_path):
    folder = tmp_path / "job"
    with _store(folder) as store:
        store.put("a", torch.ones(3))
    (folder / "index.json").write_text('{"format": "mobiuspipe-ssd-store", "vers')
    with pytest.raises(SwapIOError, match=r"index.json is not a readable store index .*move the folder away"):
        _store(folder)


def test_a_corrupted_file_fails_its_checksum(tmp_path):
    folder = tmp_path / "job"
    with _store(folder) as store:
        store.put("w", torch.randn(50_001))
        path = folder / store.info("w").file
    with open(path, "r+b") as f:
        f.seek(12_345)
        byte = f.read(1)
        f.seek(12_345)
        f.write(bytes([byte[0] ^ 0x10]))
    with _store(folder) as store:
        with pytest.raises(SwapIOError, match=r"checksum mismatch reading tensor 'w' from .*cannot be trusted") as e:
            store.get("w")
        assert e.value.path == str(path)


def test_a_truncated_or_missing_file_is_a_clear_error(tmp_path):
    folder = tmp_path / "job"
    with _store(folder) as store:
        store.put("a", torch.randn(30_000))
        store.put("b", torch.randn(30_000))
        os.truncate(folder / store.info("a").file, 4096)
        os.unlink(folder / store.info("b").file)
        with pytest.raises(SwapIOError, match=r"is 4096 bytes, but it holds 120000 bytes .* truncated"):
            store.get("a")
        with pytest.raises(SwapIOError, match=r"is missing: the store's index names it"):
            store.get("b")


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_failed_write_marks_the_tensor_damaged_until_rewritten(tmp_path, backend):
    with _store(tmp_path / "job", backend) as store:
        store.put("k", torch.randn(200_000))
        store.engine.inject_fault(1, errno.EIO)
        with pytest.raises(SwapIOError, match="EIO .*dmesg") as e:
            store.put("k", torch.randn(200_000))
        assert e.value.errno == errno.EIO and e.value.path.endswith(store.info("k").file)
        with pytest.raises(SwapIOError, match=r"tensor 'k' .* cannot be trusted: its last write failed"):
            store.get("k")
        new = torch.randn(200_000)
        store.put("k", new)
        assert torch.equal(store.get("k"), new)


def test_a_full_disk_fails_at_allocation_with_enospc(tmp_path):
    """A real 1 MiB tmpfs (mounted in a user namespace): the store reserves blocks before writing."""
    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1)")
    mnt = tmp_path / "small"
    mnt.mkdir()
    code = textwrap.dedent(f"""
        import torch
        from mobiuspipe.errors import SwapIOError
        from mobiuspipe.memory.store.ssd_store import SSDStore
        s = SSDStore({str(mnt / "job")!r})
        s.put("fits", torch.ones(1000))
        try:
            s.put("big", torch.ones(2_000_000))
        except SwapIOError as e:
            print("ERR", e.errno, e)
        print("FITS", bool((s.get("fits") == 1).all()))
    """)
    probe = subprocess.run(["unshare", "-rm", "true"], capture_output=True, timeout=30)
    if probe.returncode != 0:
        pytest.skip(f"user namespaces unavailable: {probe.stderr.decode().strip()}")
    cmd = f'mount -t tmpfs -o size=1m none {mnt} && exec {sys.executable} -c "$0"'
    out = subprocess.run(["unshare", "-rm", "sh", "-c", cmd, code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert f"ERR {errno.ENOSPC} allocation of " in out.stdout and "disk is full" in out.stdout
    assert "FITS True" in out.stdout


def test_a_failed_allocation_keeps_a_checkpoint_linked_record(tmp_path, monkeypatch):
    """A key whose file a checkpoint links gets a new file at its next put; when allocating it fails (a full disk),
    the key keeps its old file, still readable after a flush (which unlinks the files no key names)."""
    s = _store(tmp_path / "store")
    want = torch.arange(1000, dtype=torch.float32)
    s.put("k", want)
    s.flush()
    s.link_to("k", str(tmp_path / s.info("k").file))  # a checkpoint's link

    def full(fd, off, n):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(SwapIOError):
        s.put("k", torch.zeros(1000))
    monkeypatch.undo()
    s.flush()
    assert torch.equal(s.get("k"), want)
    s.close()


def test_a_folder_that_refuses_o_direct_falls_back_with_a_note(tmp_path, monkeypatch):
    """As tmpfs did before Linux 6.6: open(O_DIRECT) fails with EINVAL."""
    real_open = os.open

    def no_direct(path, flags, *a):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *a)

    monkeypatch.setattr(ssd_store.os, "open", no_direct)
    with pytest.warns(RuntimeWarning, match="O_DIRECT refused .*buffered I/O"):
        store = _store(tmp_path / "job")
    assert not store.direct and "O_DIRECT refused" in store.note
    t = torch.randn(12_345)
    store.put("t", t)
    assert torch.equal(store.get("t"), t)
    store.close()


def test_direct_io_can_be_turned_off(tmp_path, monkeypatch):
    monkeypatch.setenv("MOBIUSPIPE_IO_DIRECT", "0")
    with _store(tmp_path / "job") as store:
        assert not store.direct and store.note == ""


def test_a_second_store_in_the_same_process_is_told_to_close_the_first(tmp_path):
    with _store(tmp_path / "job"):
        with pytest.raises(SwapIOError, match=f"open already in this process \\(pid {os.getpid()}\\).*close the first"):
            _store(tmp_path / "job")
    _store(tmp_path / "job").close()  # released on close


def test_a_second_process_cannot_share_the_folder(tmp_path):
    code = (
        "import sys\n"
        "from mobiuspipe.errors import SwapIOError\n"
        "from mobiuspipe.memory.store.folder import lock_folder\n"
        "try:\n    lock_folder(sys.argv[1])\nexcept SwapIOError as e:\n    print(e)\n    sys.exit(3)\n"
    )
    with _store(tmp_path / "job"):
        other = subprocess.run(
            [sys.executable, "-c", code, str(tmp_path / "job")], capture_output=True, text=True, timeout=120
        )
    assert other.returncode == 3, other.stderr
    assert f"in use by another process (pid {os.getpid()}); give each job its own folder" in other.stdout


def test_space_check_and_device_tensors(tmp_path):
    with _store(tmp_path / "job") as store:
        with pytest.raises(SwapIOError, match="needs .* only .* free") as e:
            store.check_space(1 << 62, "the test")
        assert e.value.errno == errno.ENOSPC
        with pytest.raises(ValueError, match="on meta: the SSD store takes CPU tensors"):
            store.put("x", torch.empty(3, device="meta"))


@pytest.mark.skipif(not _ext.HAVE_C, reason="C++ extension not built")
def test_tensors_are_verified_with_the_checksum_they_were_stored_with(tmp_path):
    """The Python engine stores zlib crc32, the C++ one CRC-32C; each reads what the other wrote."""
    t, u = torch.randn(5000), torch.randn(7, 3)
    with _store(tmp_path / "job", "python") as store:
        store.put("t", t)
        assert store.info("t").algo == "crc32"
    with _store(tmp_path / "job", "threads") as store:
        assert torch.equal(store.get("t"), t)
        store.put("u", u)
        assert store.info("u").algo == "crc32c"
    with _store(tmp_path / "job", "python") as store:
        assert torch.equal(store.get("u"), u) and torch.equal(store.get("t"), t)


def test_the_store_without_the_extension(tmp_path):
    code = textwrap.dedent("""
        import sys, warnings
        sys.modules['mobiuspipe._C'] = None
        warnings.simplefilter('ignore')
        import torch
        from mobiuspipe.memory.store.ssd_store import SSDStore
        with SSDStore(sys.argv[1]) as s:
            t = torch.randn(100_003)
            s.put("t", t)
            print(s.engine.backend, s.direct, s.info("t").algo, bool(torch.equal(s.get("t"), t)))
    """)
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "job")], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["python", "False", "crc32", "True"]


def test_a_flush_while_a_put_moves_a_key_keeps_every_file_the_index_names(tmp_path, monkeypatch):
    """A key whose file a checkpoint links moves to a new file at its next put; a flush from another thread (a
    checkpoint's, while the updater writes) that came before that put's entry moved unlinked the old file while the
    index it saved still named it: a crash then lost the key. The old file goes only once the index stops naming it."""
    s = _store(tmp_path / "store")
    s.put("k", torch.arange(1000, dtype=torch.float32))
    s.flush()
    s.link_to("k", str(tmp_path / "checkpoint.bin"))
    real, flushed = ssd_store.Entry, []

    def entry_after_a_flush(*args, **kwargs):  # runs between the write's submission and its future's tracking
        if not flushed:
            flushed.append(True)
            s.flush()
            index = json.loads((tmp_path / "store" / "index.json").read_text())
            named = [e["file"] for e in index["entries"].values()]
            assert all((tmp_path / "store" / name).exists() for name in named), named
        return real(*args, **kwargs)

    monkeypatch.setattr(ssd_store, "Entry", entry_after_a_flush)
    s.put("k", torch.zeros(1000))
    monkeypatch.undo()
    assert flushed
    s.close()
    with SSDStore(tmp_path / "store") as again:
        assert torch.equal(again.get("k"), torch.zeros(1000))
