"""GPU telemetry: probes that read the worker's GPUs, and the thread that sends their readings.

`probe()` picks NVML (`pynvml`, from NVIDIA's nvidia-ml-py) when it initialises,
else a `NoGpuProbe` that says why once and reports nothing. NVML trouble never
reaches the training loop: a value a device does not support is None, a device
that fails (lost, needs a reset) is skipped and logged once per change, and a
driver that goes away makes the probe unavailable until a re-init, retried with
backoff on the injected clock, brings it back.

A process reads only the GPUs it was given (`CUDA_VISIBLE_DEVICES`, mapped to NVML's devices
by `visible.py`; every GPU where it is unset), each under its NVML index, so that N ranks of
a node send N readings and advice reaches the rank whose GPU it is. Where the script imported
torch and initialised CUDA, each reading also says how much of the memory used is PyTorch's
cache (`torch_cache`): the memory rules leave it out.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from pydantic import ValidationError

from cohort.events.clock import Clock, SystemClock
from cohort.events.errors import InvalidValueError
from cohort.events.models import MAX_GPU_PROCESSES, GpuDevice, GpuProcess
from cohort.worker.errors import WorkerError
from cohort.worker.telemetry.visible import (
    ORDER_ENV,
    VISIBLE_ENV,
    NvmlGpu,
    NvmlMig,
    Target,
    nvml_targets,
    visible_entries,
)

LOG = logging.getLogger("cohort.worker.telemetry.gpu")

# NVML errors that say "this value is not available here", not "something broke".
_FIELD_ERRORS = ("NVMLError_NotSupported", "NVMLError_FunctionNotFound", "NVMLError_NoPermission")
# NVML errors that mean the library or driver itself is unusable: no device can be read.
_DRIVER_ERRORS = (
    "NVMLError_Uninitialized",
    "NVMLError_DriverNotLoaded",
    "NVMLError_LibraryNotFound",
    "NVMLError_LibRmVersionMismatch",
)
_REASONS = {
    "NVMLError_LibraryNotFound": "NVML library not found: no NVIDIA driver on this machine",
    "NVMLError_DriverNotLoaded": "the NVIDIA driver is not loaded",
    "NVMLError_NoPermission": "no permission to use NVML",
    "NVMLError_LibRmVersionMismatch": (
        "NVML and the NVIDIA kernel driver differ in version (driver updated without a reboot?)"
    ),
    "NVMLError_Uninitialized": "NVML is not initialised",
}


class GpuProbe(Protocol):
    """Reads the GPUs of this machine. `sample` never raises for NVML trouble; it reports less."""

    @property
    def available(self) -> bool:
        """True while readings can be taken."""
        ...

    @property
    def status(self) -> str:
        """What the probe sees, for a human: devices found, or why there is nothing."""
        ...

    def sample(self) -> tuple[GpuDevice, ...]: ...

    def close(self) -> None: ...


class NoGpuProbe:
    """A machine without GPU telemetry: says so once, then reports nothing."""

    available = False

    def __init__(self, reason: str, log: logging.Logger | None = None) -> None:
        self.status = f"no GPU telemetry: {reason}"
        (log or LOG).info("%s; GPU readings will not be sent", self.status)

    def sample(self) -> tuple[GpuDevice, ...]:
        return ()

    def close(self) -> None:
        pass


def _named(nvml: Any, exc: BaseException, names: tuple[str, ...]) -> str | None:
    """The first of `names` (NVMLError subclasses of `nvml`) that `exc` is an instance of."""
    for name in names:
        cls = getattr(nvml, name, None)
        if isinstance(cls, type) and isinstance(exc, cls):
            return name
    return None


def nvml_failure(nvml: Any, exc: BaseException) -> str:
    """A sentence for an NVML error: the known causes spelled out, else NVML's own text."""
    name = _named(nvml, exc, tuple(_REASONS))
    return _REASONS[name] if name else f"NVML error: {exc} ({type(exc).__name__})"


class _DriverGone(WorkerError):
    """NVML stopped answering mid-run: the sampler says why once and stops. Control flow
    inside the sampler, never raised to a caller."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def torch_cache(ordinal: int) -> int | None:
    """Bytes PyTorch's caching allocator holds on this process's CUDA device `ordinal` with no
    tensor in them (reserved - allocated): memory NVML counts as used that the process's next
    tensors reuse. None unless the script imported torch and CUDA is initialised: this never
    imports torch nor opens a CUDA context itself."""
    cuda = getattr(sys.modules.get("torch"), "cuda", None)
    try:
        if cuda is None or not cuda.is_initialized():
            return None
        return max(0, int(cuda.memory_reserved(ordinal)) - int(cuda.memory_allocated(ordinal)))
    except Exception:  # torch half imported, a device it does not have: no figure
        return None


def nvml_gpus(nvml: Any) -> tuple[NvmlGpu, ...]:
    """The facts of every GPU an initialised NVML sees (index, UUID, name, PCI bus id, MIG
    instances). A fact a device cannot tell is left empty; a driver error raises NVMLError."""

    def told(fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except nvml.NVMLError as exc:
            if _named(nvml, exc, _DRIVER_ERRORS):
                raise
            return None

    gpus = []
    for index in range(int(nvml.nvmlDeviceGetCount())):
        handle = told(nvml.nvmlDeviceGetHandleByIndex, index)
        if handle is None:  # lost: read (and skipped, said) with the others
            gpus.append(NvmlGpu(index, ""))
            continue
        pci = told(nvml.nvmlDeviceGetPciInfo, handle)
        mode = told(nvml.nvmlDeviceGetMigMode, handle)
        mig = mode is not None and mode[0] == nvml.NVML_DEVICE_MIG_ENABLE
        slots = int(told(nvml.nvmlDeviceGetMaxMigDeviceCount, handle) or 0) if mig else 0
        migs = []
        for slot in range(slots):  # an empty slot raises NotFound: told() makes it None
            instance = told(nvml.nvmlDeviceGetMigDeviceHandleByIndex, handle, slot)
            uuid = told(nvml.nvmlDeviceGetUUID, instance) if instance is not None else None
            if uuid:
                migs.append(NvmlMig(slot, _text(uuid)))
        gpus.append(
            NvmlGpu(
                index=index,
                uuid=_text(told(nvml.nvmlDeviceGetUUID, handle) or ""),
                name=_text(told(nvml.nvmlDeviceGetName, handle) or ""),
                pci_bus_id=_text(pci.busId) if pci is not None else "",
                mig=mig,
                migs=tuple(migs),
            )
        )
    return tuple(gpus)


def read_gpus(nvml: Any = None) -> tuple[tuple[NvmlGpu, ...], str]:
    """Every GPU NVML sees here, read once (NVML opened and shut), and a few words on what
    was seen; without NVML, none and why. For a launcher, which opens no CUDA context."""
    if nvml is None:
        try:
            import pynvml
        except ImportError as exc:
            return (), f"nvidia-ml-py is not installed ({exc})"
        nvml = pynvml
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as exc:
        return (), nvml_failure(nvml, exc)
    try:
        gpus = nvml_gpus(nvml)
    except nvml.NVMLError as exc:
        return (), nvml_failure(nvml, exc)
    finally:
        with contextlib.suppress(nvml.NVMLError):
            nvml.nvmlShutdown()
    migs = sum(len(g.migs) for g in gpus if g.mig)
    return gpus, f"NVML sees {len(gpus)} GPU(s)" + (f", {migs} MIG instance(s)" if migs else "")


def _text(value: str | bytes) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value


class NvmlProbe:
    """GPU readings through NVML. Inject `nvml` (a pynvml-like module) in tests.

    NVML is initialised once by `open()` (or the first `sample()`); while it is
    unavailable, `sample()` returns () and retries the init after `retry`
    seconds, doubling up to `max_retry`. It reads the devices `env`'s
    `CUDA_VISIBLE_DEVICES` gives the process (default: this process's
    environment), and asks `cache` (default `torch_cache`) for each one's
    PyTorch cache by its CUDA ordinal.
    """

    def __init__(
        self,
        nvml: Any = None,
        *,
        clock: Clock | None = None,
        log: logging.Logger | None = None,
        retry: float = 5.0,
        max_retry: float = 300.0,
        env: Mapping[str, str] | None = None,
        cache: Callable[[int], int | None] = torch_cache,
    ) -> None:
        self._nvml = nvml
        env = os.environ if env is None else env
        given = env.get(VISIBLE_ENV)
        self._entries = visible_entries(given) if given is not None else None
        self._pci_order = env.get(ORDER_ENV, "").upper() == "PCI_BUS_ID"
        self._cache = cache
        self._targets: tuple[Target, ...] = ()
        self._problem = ""
        self._clock: Clock = clock or SystemClock()
        self._log = log or LOG
        self._retry = retry
        self._max_retry = max_retry
        self._backoff = retry
        self._retry_at: float | None = None  # None: never tried
        self._initialised = False
        self._reason = "NVML is not initialised yet"
        self._count = 0  # the GPUs NVML sees (the targets were mapped for this many)
        self._devices: dict[str, str] = {}  # target label -> "" (fine) or why it is skipped
        self._lock = threading.Lock()

    @property
    def available(self) -> bool:
        return self._initialised

    @property
    def status(self) -> str:
        with self._lock:
            if self._initialised:
                skipped = sum(1 for why in self._devices.values() if why)
                extra = f", {skipped} skipped" if skipped else ""
                return f"NVML: {len(self._targets)} device(s){extra}"
            return f"NVML unavailable: {self._reason}"

    def open(self, *, quiet: bool = False) -> bool:
        """Initialise NVML now; False (with `status` saying why) if it cannot be used.

        `quiet` keeps a first failure out of the log, for a caller that reports it itself.
        """
        with self._lock:
            return self._init(quiet=quiet)

    def sample(self) -> tuple[GpuDevice, ...]:
        with self._lock:
            if not self._initialised:
                if self._retry_at is not None and self._clock.monotonic() < self._retry_at:
                    return ()
                if not self._init():
                    return ()
            try:
                return self._read_all()
            except _DriverGone as gone:
                self._lost(gone.reason)
                return ()

    def close(self) -> None:
        with self._lock:
            if self._initialised:
                self._shutdown()
            self._reason = "closed"
            self._retry_at = float("inf")

    # ------------------------------------------------------------ internals (lock held)

    def _module(self) -> Any:
        if self._nvml is None:
            import pynvml  # lazily: importing is cheap, but only NVML users need it

            self._nvml = pynvml
        return self._nvml

    def _init(self, *, quiet: bool = False) -> bool:
        first = self._retry_at is None
        try:
            nvml = self._module()
        except ImportError as exc:
            return self._failed(f"nvidia-ml-py is not installed ({exc})", quiet and first)
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as exc:
            return self._failed(nvml_failure(nvml, exc), quiet and first)
        self._initialised = True
        self._backoff = self._retry
        self._devices.clear()
        try:
            self._map(nvml)
            driver = nvml.nvmlSystemGetDriverVersion()
        except nvml.NVMLError as exc:
            self._shutdown()
            return self._failed(nvml_failure(nvml, exc), quiet and first)
        if isinstance(driver, bytes):
            driver = driver.decode(errors="replace")
        again = "" if first else " again"
        reads = ", ".join(t.label for t in self._targets) or "none"
        self._log.info(
            "NVML is available%s: driver %s, %d GPU(s); this process reads GPU %s",
            again,
            driver,
            self._count,
            reads,
        )
        self._retry_at = None
        return True

    def _map(self, nvml: Any) -> None:
        """The devices this process reads, from NVML's facts now; a variable that names a
        device NVML does not see is said once."""
        gpus = nvml_gpus(nvml)
        self._count = len(gpus)
        mapped = nvml_targets(self._entries, gpus, self._pci_order)
        if mapped.problem and mapped.problem != self._problem:
            self._log.warning("GPU readings of this process: %s", mapped.problem)
        self._problem = mapped.problem
        self._targets = mapped.targets
        for gone in set(self._devices) - {t.label for t in self._targets}:
            del self._devices[gone]

    def _failed(self, reason: str, quiet: bool) -> bool:
        if reason != self._reason and not quiet:
            self._log.warning("NVML unavailable: %s; GPU readings paused", reason)
        self._reason = reason
        self._initialised = False
        self._retry_at = self._clock.monotonic() + self._backoff
        self._backoff = min(self._backoff * 2, self._max_retry)
        return False

    def _lost(self, reason: str) -> None:
        self._shutdown()
        self._log.warning(
            "NVML stopped working: %s; GPU readings paused, retrying in %.0f s",
            reason,
            self._backoff,
        )
        self._reason = reason
        self._retry_at = self._clock.monotonic() + self._backoff
        self._backoff = min(self._backoff * 2, self._max_retry)

    def _shutdown(self) -> None:
        nvml = self._module()
        self._initialised = False
        with contextlib.suppress(nvml.NVMLError):  # a driver already gone has nothing to release
            nvml.nvmlShutdown()

    def _read_all(self) -> tuple[GpuDevice, ...]:
        nvml = self._module()
        try:
            if int(nvml.nvmlDeviceGetCount()) != self._count:  # a GPU came or went
                self._map(nvml)
        except nvml.NVMLError as exc:
            raise _DriverGone(nvml_failure(nvml, exc)) from exc
        devices = []
        for target in self._targets:
            try:
                device = self._read(nvml, target)
            except nvml.NVMLError as exc:
                if _named(nvml, exc, _DRIVER_ERRORS):
                    raise _DriverGone(nvml_failure(nvml, exc)) from exc
                self._device_state(target.label, nvml_failure(nvml, exc))
                continue
            except ValidationError as exc:  # a value no real GPU reports: a broken driver
                self._device_state(target.label, f"implausible values: {exc.errors()[0]['msg']}")
                continue
            self._device_state(target.label, "")
            devices.append(device)
        return tuple(devices)

    def _device_state(self, label: str, why: str) -> None:
        """Log a device's state when it changes: skipped (and why), or back."""
        before = self._devices.get(label, "")
        self._devices[label] = why
        if why and why != before:
            self._log.warning("GPU %s skipped: %s", label, why)
        elif before and not why:
            self._log.info("GPU %s is readable again", label)

    def _read(self, nvml: Any, target: Target) -> GpuDevice:
        handle = nvml.nvmlDeviceGetHandleByIndex(target.index)
        if target.mig_slot is not None:
            handle = nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, target.mig_slot)

        def optional(fn: Callable[..., Any], *args: Any) -> Any:
            try:
                return fn(handle, *args)
            except nvml.NVMLError as exc:
                if _named(nvml, exc, _FIELD_ERRORS):
                    return None
                raise

        name = optional(nvml.nvmlDeviceGetName)
        if isinstance(name, bytes):
            name = name.decode(errors="replace")
        memory = optional(nvml.nvmlDeviceGetMemoryInfo)
        rates = optional(nvml.nvmlDeviceGetUtilizationRates)
        temperature = optional(nvml.nvmlDeviceGetTemperature, nvml.NVML_TEMPERATURE_GPU)
        milliwatts = optional(nvml.nvmlDeviceGetPowerUsage)
        running = optional(nvml.nvmlDeviceGetComputeRunningProcesses) or []
        processes = sorted(
            (GpuProcess(pid=int(p.pid), used_memory=p.usedGpuMemory) for p in running),
            key=lambda p: -(p.used_memory or 0),
        )[:MAX_GPU_PROCESSES]
        cached = self._cache(target.ordinal) if target.ordinal is not None else None
        return GpuDevice(
            index=target.index,
            name=(name or "")[:128],
            memory_total=memory.total if memory is not None else 0,
            memory_used=memory.used if memory is not None else 0,
            memory_free=memory.free if memory is not None else None,
            utilization_gpu=rates.gpu if rates is not None else None,
            utilization_memory=rates.memory if rates is not None else None,
            temperature=temperature,
            power_w=milliwatts / 1000.0 if milliwatts is not None else None,
            processes=tuple(processes),
            memory_cached=cached,
        )


def probe(
    log: logging.Logger | None = None,
    *,
    nvml: Any = None,
    clock: Clock | None = None,
    env: Mapping[str, str] | None = None,
) -> GpuProbe:
    """The NVML probe of this process's GPUs (`env`: its environment) if NVML initialises
    here, else a NoGpuProbe saying why."""
    nvml_probe = NvmlProbe(nvml, clock=clock, log=log, env=env)
    if nvml_probe.open(quiet=True):
        return nvml_probe
    reason = nvml_probe.status.removeprefix("NVML unavailable: ")
    nvml_probe.close()
    return NoGpuProbe(reason, log=log)


class GpuSampler:
    """Samples `probe` every `interval` seconds and hands non-empty readings to `send`.

    `tick()` takes a sample when one is due by `clock` (tests call it directly);
    `start()` runs it in a daemon thread until `stop` is set. Nothing raised by
    the probe or by `send` leaves the thread: it is logged, once per distinct error.
    """

    def __init__(
        self,
        probe: GpuProbe,
        send: Callable[[tuple[GpuDevice, ...]], None],
        interval: float,
        stop: threading.Event,
        clock: Clock | None = None,
        log: logging.Logger | None = None,
    ) -> None:
        if not interval > 0:
            raise InvalidValueError(f"the GPU sampling interval must be positive, got {interval!r}")
        self.probe = probe
        self.send = send
        self.interval = interval
        self.stop = stop
        self.clock: Clock = clock or SystemClock()
        self.log = log or LOG
        self._next: float | None = None
        self._last_error = ""
        self._thread: threading.Thread | None = None

    def tick(self) -> bool:
        """Sample and send if a sample is due; True if one was taken."""
        now = self.clock.monotonic()
        if self._next is not None and now < self._next:
            return False
        self._next = now + self.interval
        try:
            devices = self.probe.sample()
            if devices:
                self.send(devices)
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
            if error != self._last_error:
                self.log.exception("GPU sampling failed; will try again in %.3g s", self.interval)
            self._last_error = error
        else:
            self._last_error = ""
        return True

    def run(self) -> None:
        while not self.stop.is_set():
            self.tick()
            due = self._next if self._next is not None else self.clock.monotonic()
            self.stop.wait(min(self.interval, max(0.0, due - self.clock.monotonic())))

    def start(self, name: str = "cohort-gpu") -> threading.Thread:
        self._thread = threading.Thread(target=self.run, name=name, daemon=True)
        self._thread.start()
        return self._thread

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)
