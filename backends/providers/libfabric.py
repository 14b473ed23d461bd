"""libfabric providers (tcp;ofi_rxm, shm, efa, verbs;ofi_rxm: registry rows) behind the Domain interface.

Opening a libfabric domain can install C-level signal handlers (the shm provider cleans up its
shared memory on SIGINT/SIGTERM and friends), replacing the Python handlers the application set: a
seed's SIGTERM would then end the process without draining. `open_domains` records the Python-level
handlers before and puts them back after (Python allows that only on the main thread; elsewhere it
logs what it could not restore).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import signal
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

from backends.errors import BackendUnavailable, EngineClosed, TransferError
from backends.providers._native import LIB_ENV, LIBRARY, VERSION, ffi, lib
from backends.providers.domain import (
    POST_FAILED,
    RECV_BASE,
    Completion,
    Domain,
    LocalRegistration,
    RmaOp,
    WriteBatch,
)
from backends.providers.registry import lookup

log = logging.getLogger(__name__)

_CQ_BATCH = 256
_POST_BATCH = 256
assert lib.RF_POST_FAILED == POST_FAILED, "the C core's constants drifted"
assert lib.RF_RECV_BASE == RECV_BASE, "the C core's constants drifted"
_ALL_MR_MODES = ("FI_MR_LOCAL", "FI_MR_VIRT_ADDR", "FI_MR_ALLOCATED", "FI_MR_ENDPOINT")


def libfabric_version() -> tuple[int, int]:
    """(major, minor) of the libfabric loaded at run time (see backends.providers._native)."""
    return VERSION


def libfabric_library() -> str:
    """Which libfabric file is loaded: a path, or "system" for the one the binding was linked against."""
    return LIBRARY or "system"


def refuses_forged_writes(provider: str, version: tuple[int, int] | None = None) -> bool:
    """Whether the target's provider refuses a write into memory registered without FI_REMOTE_WRITE.

    shm before 2.5 does not check (1.17 let a forged write through; 2.5 has a new shm that refuses it;
    the versions between are untested, so treated as not checking). tcp refuses on 1.17 and 2.5.
    efa and verbs check in hardware (not run here).
    """
    version = VERSION if version is None else version
    return not (provider == "shm" and version < (2, 5))


def closes_with_ops_posted(provider: str, version: tuple[int, int] | None = None) -> bool:
    """Whether an endpoint can be closed while RMA ops are still posted to a peer that stopped.

    tcp on 1.17 (RxM over tcp) can segfault in fi_close then: its flush of the cancelled ops reads
    their freed contexts (seen about once in ten closes under load, on the Python progress loop and
    the native core alike). Later versions are untested here and treated as safe.
    """
    version = VERSION if version is None else version
    return not (provider == "tcp" and version < (1, 18))


def refuses_forged_reads(provider: str, version: tuple[int, int] | None = None) -> bool:
    """Whether the target's provider refuses a read of memory registered without FI_REMOTE_READ.

    tcp does not check on 1.17 nor 2.5.1, shm only from 2.5: a write-only region is protected from
    reads only by its key (random 64-bit), which only the peers handed its descriptor know.
    """
    version = VERSION if version is None else version
    if provider == "tcp":
        return False
    return refuses_forged_writes(provider, version)


ALLOW_UNENFORCED_ENV = "RFORK_ALLOW_UNENFORCED_ACCESS"


def pairs_within_process(provider: str, version: tuple[int, int] | None = None) -> bool:
    """Whether two endpoints of one process may be peers of each other on this provider.

    shm from 2.5 (2.5.1 tested) crashes inside fi_cq_read once two endpoints of one process have both
    read from or written to each other (docs/transport.md), so rfork refuses such a peer there with
    BackendUnavailable rather than let the process segfault. Separate processes are unaffected.
    """
    version = VERSION if version is None else version
    return not (provider == "shm" and version >= (2, 5))


def shm_address_pid(straddr: str) -> int | None:
    """The process id a shm address names (`fi_shm://<pid>:...`), or None for any other address."""
    prefix = "fi_shm://"
    if not straddr.startswith(prefix):
        return None
    head = straddr[len(prefix):].split(":", 1)[0]
    return int(head) if head.isdigit() else None


_SHM_DIR = "/dev/shm"
_swept_for_pid: int | None = None


def _remove_stale_shm_segments() -> None:
    """Remove shm segments a dead process with this process's id left behind (once per process).

    shm names its segment `<pid>:<n>:<m>` and 1.17 fails fi_enable with EBUSY when that name exists:
    after a SIGKILL the segment stays, and once the pid is reused the new process cannot open shm.
    Before this process opens its first shm endpoint, no segment with its pid can be its own.
    """
    global _swept_for_pid
    pid = os.getpid()
    if _swept_for_pid == pid:
        return
    _swept_for_pid = pid
    prefix = f"{pid}:"
    with contextlib.suppress(OSError):
        for name in os.listdir(_SHM_DIR):
            tail = name[len(prefix):].split(":")
            if name.startswith(prefix) and len(tail) >= 2 and all(t.isdigit() for t in tail):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(_SHM_DIR, name))
                    log.warning("removed stale shm segment %s/%s left by a dead process", _SHM_DIR, name)


def _check(ret: int, what: str) -> None:
    if ret < 0:
        msg = ffi.string(lib.fi_strerror(-ret)).decode()
        raise TransferError(f"{what} failed: {msg} ({ret})")


def _getinfo(hint: str, host: str | None, prov_key: bool) -> Any:
    hints = lib.fi_allocinfo()
    if hints == ffi.NULL:
        raise MemoryError("fi_allocinfo")
    try:
        hints.caps = (
            lib.FI_MSG | lib.FI_RMA | lib.FI_READ | lib.FI_WRITE | lib.FI_REMOTE_READ | lib.FI_REMOTE_WRITE
        )
        hints.ep_attr.type = lib.FI_EP_RDM
        mode = 0
        for name in _ALL_MR_MODES:
            mode |= getattr(lib, name)
        if prov_key:
            mode |= lib.FI_MR_PROV_KEY
        hints.domain_attr.mr_mode = mode
        hints.domain_attr.threading = lib.FI_THREAD_SAFE
        if lib.rf_set_prov_name(hints, hint.encode()) != 0:
            raise MemoryError("strdup")
        out = ffi.new("struct fi_info **")
        node = host.encode() if host else ffi.NULL
        flags = lib.FI_SOURCE if host else 0
        ret = lib.fi_getinfo(lib.rf_api_version(), node, b"0" if host else ffi.NULL, flags, hints, out)
        if ret < 0:
            return None
        return out[0]
    finally:
        lib.fi_freeinfo(hints)


def open_info(provider: str, host: str | None) -> Any:
    """fi_getinfo for a provider (its registry row's hint: rxm gives RDM over connected providers);
    without FI_MR_PROV_KEY first, so that we choose random keys."""
    hint = lookup(provider).hint
    info = _getinfo(hint, host, prov_key=False) or _getinfo(hint, host, prov_key=True)
    if info is None:
        raise BackendUnavailable(f"libfabric provider {hint!r} is not available on this machine")
    return info


def open_domains(provider: str, count: int, *, host: str | None) -> list[LibfabricDomain]:
    """Open `count` domains of a provider, keeping the application's Python signal handlers."""
    domains: list[LibfabricDomain] = []
    try:
        with _preserved_signal_handlers():
            for _ in range(count):
                domains.append(LibfabricDomain(provider, host=host))
    except BaseException:
        for dom in domains:
            dom.close()
        raise
    return domains


_WATCHED_SIGNALS = tuple(
    getattr(signal, name)
    for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGPIPE", "SIGABRT")
    if hasattr(signal, name)
)


@contextlib.contextmanager
def _preserved_signal_handlers() -> Iterator[None]:
    """Run the body, then reinstall the Python handlers it displaced (main thread only)."""
    before: dict[int, Any] = {}
    for sig in _WATCHED_SIGNALS:
        with contextlib.suppress(ValueError, OSError):
            before[sig] = signal.getsignal(sig)
    try:
        yield
    finally:
        on_main = threading.current_thread() is threading.main_thread()
        for sig, handler in before.items():
            if handler is None:  # installed outside Python: getsignal cannot tell, leave it
                continue
            if not on_main:
                log.debug("not on the main thread: cannot re-check the handler of signal %d", sig)
                continue
            try:
                # set it again even if getsignal still reports it: libfabric replaces the C-level
                # handler with sigaction, which Python's bookkeeping does not see
                signal.signal(sig, handler)
            except (ValueError, OSError, TypeError):
                log.warning("could not restore the handler of signal %d after opening libfabric", sig)


def provider_available(provider: str, host: str | None = None) -> bool:
    """True when fi_getinfo finds the provider (backends.providers.registry asks this module)."""
    try:
        info = open_info(provider, host)
    except BackendUnavailable:
        return False
    lib.fi_freeinfo(info)
    return True


class LibfabricDomain(Domain):
    """fabric + domain + CQ + AV + RDM endpoint for one libfabric provider."""

    def __init__(self, provider: str, *, host: str | None) -> None:
        self.provider = provider
        self.refuses_forged_writes = refuses_forged_writes(provider)
        self.closes_with_ops_posted = closes_with_ops_posted(provider)
        self._info = open_info(provider, host)
        self._fids: list[Any] = []
        self._lock = threading.Lock()  # registrations and AV inserts from user threads
        self._core: Any = ffi.NULL
        self._submit_lock = threading.Lock()  # submissions from any thread share one staging array
        try:
            self._open()
        except BaseException:
            self.close()
            raise

    def _open(self) -> None:
        info = self._info
        dattr = info.domain_attr
        self.mr_mode = int(dattr.mr_mode)
        if self.mr_mode & lib.FI_MR_RAW:
            raise BackendUnavailable(f"{self.provider}: FI_MR_RAW keys are not supported")
        self.mr_virt_addr = bool(self.mr_mode & lib.FI_MR_VIRT_ADDR)
        self.prov_key = bool(self.mr_mode & lib.FI_MR_PROV_KEY)
        self.mr_local = bool(self.mr_mode & lib.FI_MR_LOCAL)
        self.mr_endpoint = bool(self.mr_mode & lib.FI_MR_ENDPOINT)
        self.key_bytes = min(int(dattr.mr_key_size) or 8, 8)
        self.max_inflight = max(8, min(int(info.tx_attr.size) or 64, 64))
        tx = info.tx_attr
        self.max_segs = max(1, min(int(tx.iov_limit), int(tx.rma_iov_limit), int(lib.RF_MAX_SEGS)))
        # shm copies a write with one remote iov itself, at once; with several it queues a command
        # that the peer's progress must serve (on 1.17 a post then spun forever on a dead peer's lock)
        self.scatters = self.provider != "shm"
        self.remote_cq_data_flag = int(lib.FI_REMOTE_CQ_DATA)
        self.recv_flag = int(lib.FI_RECV_FLAG)
        fab = ffi.new("struct fid_fabric **")
        _check(lib.fi_fabric(info.fabric_attr, fab, ffi.NULL), "fi_fabric")
        self._fabric = fab[0]
        self._fids.append(self._fabric)
        dom = ffi.new("struct fid_domain **")
        _check(lib.fi_domain(self._fabric, info, dom, ffi.NULL), "fi_domain")
        self._domain = dom[0]
        self._fids.append(self._domain)
        cq = ffi.new("struct fid_cq **")
        attr = ffi.new("struct fi_cq_attr *")
        attr.size = 0
        attr.format = lib.FI_CQ_FORMAT_DATA
        attr.wait_obj = lib.FI_WAIT_UNSPEC
        # shm 1.17 accepts a wait object but fi_cq_sread ignores its timeout there: sleep instead.
        self.can_wait = self.provider != "shm" and lib.fi_cq_open(self._domain, attr, cq, ffi.NULL) == 0
        if not self.can_wait:
            attr.wait_obj = lib.FI_WAIT_NONE
            _check(lib.fi_cq_open(self._domain, attr, cq, ffi.NULL), "fi_cq_open")
        self._cq = cq[0]
        self._fids.append(self._cq)
        av = ffi.new("struct fid_av **")
        aattr = ffi.new("struct fi_av_attr *")
        aattr.type = lib.FI_AV_TABLE
        _check(lib.fi_av_open(self._domain, aattr, av, ffi.NULL), "fi_av_open")
        self._av = av[0]
        self._fids.append(self._av)
        if self.provider == "shm":
            _remove_stale_shm_segments()
        ep = ffi.new("struct fid_ep **")
        _check(lib.fi_endpoint(self._domain, info, ep, ffi.NULL), "fi_endpoint")
        self._ep = ep[0]
        self._fids.append(self._ep)
        _check(
            lib.fi_ep_bind(self._ep, ffi.cast("struct fid *", self._cq), lib.FI_TRANSMIT | lib.FI_RECV_FLAG),
            "fi_ep_bind(cq)",
        )
        _check(lib.fi_ep_bind(self._ep, ffi.cast("struct fid *", self._av), 0), "fi_ep_bind(av)")
        _check(lib.fi_enable(self._ep), "fi_enable")
        buf = ffi.new("char[256]")
        size = ffi.new("size_t *", 256)
        _check(lib.fi_getname(ffi.cast("struct fid *", self._ep), buf, size), "fi_getname")
        self.name = bytes(ffi.buffer(buf, size[0]))
        self._entries = ffi.new("struct fi_cq_data_entry[]", _CQ_BATCH)
        self._out = ffi.new("uint64_t[]", 4 * _CQ_BATCH)
        self._sub_ops = ffi.new("struct rf_op[]", _POST_BATCH)
        self._tmpl = ffi.new("struct rf_op[]", 1)
        self._recs = ffi.new("struct rf_rec[]", _CQ_BATCH)
        self._err = ffi.new("struct fi_cq_err_entry *")
        self._peers: dict[bytes, int] = {}
        log.debug(
            "opened %s domain mr_mode=%#x wait=%s inflight=%d segs=%d",
            self.provider,
            self.mr_mode,
            self.can_wait,
            self.max_inflight,
            self.max_segs,
        )

    def straddr(self, raw: bytes) -> str:
        buf = ffi.new("char[128]")
        size = ffi.new("size_t *", 128)
        lib.fi_av_straddr(self._av, raw, buf, size)
        return ffi.string(buf).decode(errors="replace")

    def insert_peer(self, raw: bytes) -> int:
        with self._lock:
            known = self._peers.get(raw)
            if known is not None:
                return known
            if not pairs_within_process(self.provider) and shm_address_pid(self.straddr(raw)) == os.getpid():
                raise BackendUnavailable(
                    f"shm on libfabric {VERSION[0]}.{VERSION[1]} crashes when two endpoints of one process "
                    f"are peers ({self.straddr(raw)} is in this process); put them in separate processes, "
                    f"use tcp, or libfabric 1.17 ({LIB_ENV}=system)"
                )
            out = ffi.new("fi_addr_t *")
            ret = lib.fi_av_insert(self._av, raw, 1, out, 0, ffi.NULL)
            if ret != 1:
                raise TransferError(f"fi_av_insert of peer {self.straddr(raw)} failed ({ret})")
            self._peers[raw] = int(out[0])
            return int(out[0])

    def register(self, ptr: int, nbytes: int, remote_read: bool, remote_write: bool) -> LocalRegistration:
        if remote_read and not remote_write and not self.refuses_forged_writes and not _unenforced_allowed():
            raise BackendUnavailable(
                f"{self.provider} on libfabric {VERSION[0]}.{VERSION[1]} does not enforce remote access, so "
                f"a peer could write a read-only region; use libfabric >= 2.5 ({LIB_ENV}=mpich) or tcp, or "
                f"set {ALLOW_UNENFORCED_ENV}=1 where every peer on this host is trusted"
            )
        access = lib.FI_READ | lib.FI_WRITE | lib.FI_SEND | lib.FI_RECV_FLAG
        if remote_read:
            access |= lib.FI_REMOTE_READ
        if remote_write:
            access |= lib.FI_REMOTE_WRITE
        mr = ffi.new("struct fid_mr **")
        for _attempt in range(4):
            key = 0 if self.prov_key else secrets.randbits(8 * self.key_bytes)
            ret = lib.fi_mr_reg(
                self._domain, ffi.cast("void *", ptr), nbytes, access, 0, key, 0, mr, ffi.NULL
            )
            if ret != -errno.ENOKEY:
                break
        _check(ret, f"fi_mr_reg({nbytes} bytes)")
        handle = mr[0]
        try:
            if self.mr_endpoint:
                _check(lib.fi_mr_bind(handle, ffi.cast("struct fid *", self._ep), 0), "fi_mr_bind")
                _check(lib.fi_mr_enable(handle), "fi_mr_enable")
        except TransferError:
            lib.fi_close(ffi.cast("struct fid *", handle))
            raise
        desc = lib.fi_mr_desc(handle) if self.mr_local else None
        return LocalRegistration(int(lib.fi_mr_key(handle)), desc, handle)

    def deregister(self, reg: LocalRegistration) -> None:
        _check(lib.fi_close(ffi.cast("struct fid *", reg.handle)), "fi_close(mr)")

    # ----- the native progress core (one pthread per domain; see native/progress_core.c) --------
    def start_core(self) -> None:
        if self._core != ffi.NULL:
            return
        core = lib.rf_core_new(self._ep, self._cq, int(self.can_wait), self.max_inflight)
        if core == ffi.NULL:
            raise MemoryError("rf_core_new")
        # Freed only when the last reference goes: a thread inside rf_core_drain/submit/cancel holds
        # one (its local), so no call into C can meet a freed core however close and drain interleave.
        self._core = ffi.gc(core, lib.rf_core_free)
        rc = lib.rf_core_start(core)
        if rc != 0:
            raise TransferError(f"{self.provider}: cannot start the progress thread (errno {rc})")

    def submit(self, ops: Sequence[RmaOp]) -> None:
        with self._submit_lock:
            if self._core == ffi.NULL:
                raise EngineClosed(f"{self.provider}: the domain's progress core is not running")
            arr, start = self._sub_ops, 0
            while start < len(ops):
                batch = ops[start].batch
                if batch is not None:
                    self._submit_batch(ops[start], batch)
                    start += 1
                    continue
                n = 1
                while n < _POST_BATCH and start + n < len(ops) and ops[start + n].batch is None:
                    n += 1
                _fill(arr, ops, start, n)
                if lib.rf_core_submit(self._core, arr, n) < 0:
                    raise EngineClosed(f"{self.provider}: the domain's progress core has stopped")
                start += n

    def _submit_batch(self, op: RmaOp, batch: WriteBatch) -> None:
        """Queue one batch of writes: the core groups and posts them, and completes them as one record."""
        if batch.pieces.itemsize != 8 or not batch.pieces or len(batch.pieces) % 3:
            raise TransferError(f"{self.provider}: a write batch takes (address, address, length) triples")
        tmpl = self._tmpl
        _fill(tmpl, [op], 0, 1)
        pieces = ffi.from_buffer(batch.pieces)  # read during the call only
        rc = lib.rf_core_submit_batch(
            self._core, tmpl, ffi.cast("uint64_t *", pieces), len(batch.pieces) // 3, self.max_segs,
            int(self.scatters), batch.max_bytes, batch.ungathered_upto, batch.dc_upto,
        )
        if rc == -2:
            raise TransferError(f"{self.provider}: malformed write batch")
        if rc < 0:
            raise EngineClosed(f"{self.provider}: the domain's progress core has stopped")

    def drain(self, timeout_s: float) -> list[Completion] | None:
        core, recs = self._core, self._recs
        if core == ffi.NULL:  # never started
            return None
        n = lib.rf_core_drain(core, recs, _CQ_BATCH, max(1, int(timeout_s * 1e6)))
        if n < 0:
            return None
        out = []
        for i in range(n):
            r = recs[i]
            err = int(r.err)
            out.append(Completion(int(r.ctx), int(r.flags), int(r.len), int(r.data), err,
                                  ffi.string(r.msg).decode(errors="replace") if err else ""))
        return out

    def cancel(self, *, peer: int = 0, group: int = 0) -> int:
        core = self._core
        return int(lib.rf_core_cancel(core, peer, group)) if core != ffi.NULL else 0

    def stop_core(self) -> None:
        """Stop and join the core thread (idempotent); afterwards submit raises EngineClosed and
        drain returns what is left, then None. The core's memory lives on until unreferenced."""
        core = self._core
        if core != ffi.NULL:
            lib.rf_core_stop(core)

    def post_recv(self, ptr: int, n: int, desc: Any, ctx: int) -> int:
        self.submit([_Recv(ptr, n, desc, ctx)])
        return 0

    # ----- driving the endpoint directly, where no core runs (provider tests) -------------------
    def poll(self) -> list[Completion]:
        """The completions ready now (only while the core is not started)."""
        return self._completions(lib.rf_cq_drain(self._cq, self._entries, _CQ_BATCH, self._out))

    def _completions(self, n: int) -> list[Completion]:
        if n > 0:
            v = ffi.unpack(self._out, 4 * n)
            return [Completion(v[i], v[i + 1], v[i + 2], v[i + 3]) for i in range(0, 4 * n, 4)]
        if n == 0 or n == -lib.FI_EAGAIN:
            return []
        if n == -lib.FI_EAVAIL:
            return [self._read_error()]
        _check(n, "fi_cq_read")
        return []

    def _read_error(self) -> Completion:
        err = self._err
        ret = lib.fi_cq_readerr(self._cq, err, 0)
        if ret < 0:
            return Completion(0, 0, 0, 0, errno.EIO, f"fi_cq_readerr failed ({ret})")
        buf = ffi.new("char[256]")
        detail = lib.fi_cq_strerror(self._cq, err.prov_errno, err.err_data, buf, 256)
        text = ffi.string(detail).decode(errors="replace") if detail != ffi.NULL else ""
        base = ffi.string(lib.fi_strerror(err.err)).decode()
        return Completion(
            int(ffi.cast("uintptr_t", err.op_context)),
            int(err.flags),
            int(err.len),
            int(err.data),
            int(err.err) or errno.EIO,
            f"{base}; {text}" if text else base,
        )

    def wait(self, timeout_s: float) -> list[Completion]:
        """Block in fi_cq_sread up to timeout_s (only while the core is not started)."""
        if not self.can_wait:
            time.sleep(timeout_s)
            return self.poll()
        ms = max(1, int(timeout_s * 1000))
        # 0 when it timed out, was interrupted, or was woken by signal().
        return self._completions(lib.rf_cq_wait(self._cq, self._entries, _CQ_BATCH, self._out, ms))

    def close(self) -> None:
        self.stop_core()  # its thread touches the endpoint: it is joined before the endpoint goes
        for fid in reversed(self._fids):
            ret = lib.fi_close(ffi.cast("struct fid *", fid))
            if ret < 0:
                log.warning("fi_close returned %d", ret)
        self._fids.clear()
        if self._info is not None:
            lib.fi_freeinfo(self._info)
            self._info = None


class _Recv(NamedTuple):
    """A receive buffer to post (the fields _fill reads)."""

    ptr: int
    length: int
    desc: Any
    ctx: int
    kind: int = 3
    peer: int = 0
    raddr: int = 0
    key: int = 0
    imm: int | None = None
    delivery_complete: bool = False
    group: int = 0
    hash_job: int = 0
    batch: WriteBatch | None = None


def _fill(arr: Any, ops: Sequence[RmaOp], start: int, n: int) -> None:
    """Copy ops[start:start + n] into the native op array arr[0:n]."""
    null = ffi.NULL
    for i in range(n):
        op = ops[start + i]
        o = arr[i]
        o.buf = op.ptr
        o.len = op.length
        o.desc = null if op.desc is None else op.desc
        o.peer = op.peer
        o.raddr = op.raddr
        o.key = op.key
        o.ctx = op.ctx
        o.kind = op.kind
        o.group = op.group
        o.hjob = op.hash_job
        o.nseg = 0  # gathered writes come from batches, which the core expands
        imm = op.imm
        if imm is None:
            o.flags = 2 if op.delivery_complete else 0
        else:
            o.data = imm
            o.flags = 3 if op.delivery_complete else 1


def _unenforced_allowed() -> bool:
    return os.environ.get(ALLOW_UNENFORCED_ENV, "") not in ("", "0")


def cma_permitted() -> bool:
    """shm moves bulk data with process_vm_readv, which Yama ptrace_scope >= 2 forbids."""
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            return int(f.read().strip() or 0) < 2
    except OSError:
        return True
