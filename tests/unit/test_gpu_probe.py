"""GPU probes against a fake pynvml (the real module's names and error classes), and the sampler;
each process reads the GPUs CUDA_VISIBLE_DEVICES gives it (a GPU UUID, a MIG UUID, an index)."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pynvml
import pytest

from cohort.events.clock import ManualClock
from cohort.events.models import GpuDevice
from cohort.worker.telemetry.gpu import (
    GpuProbe,
    GpuSampler,
    NoGpuProbe,
    NvmlProbe,
    probe,
    torch_cache,
)

GiB = 2**30
Handle = int | tuple[int, int]
"""A fake NVML handle: a GPU's index, or (its index, a slot) for a MIG instance."""


@dataclass
class FakeGpu:
    name: str = "NVIDIA A100-SXM4-40GB"
    total: int = 40 * GiB
    used: int = 10 * GiB
    util_gpu: int = 80
    util_memory: int = 40
    temperature: int = 65
    power_mw: int = 250_000
    processes: list[tuple[int, int | None]] = field(default_factory=lambda: [(4242, 9 * GiB)])
    errors: dict[str, type[Exception]] = field(default_factory=dict)
    """pynvml function name -> the NVMLError subclass it raises for this device."""
    lost: bool = False
    uuid: str = ""
    """Default: GPU-fake-<its index>."""
    pci_bus_id: str = ""
    """Default: 00000000:<its index, 2 hex digits>:00.0 (NVML's order is PCI bus order)."""
    migs: list[FakeGpu] | None = None
    """None: MIG mode off; else its MIG instances (their UUIDs MIG-…), one per slot."""


def mig(uuid: str, total: int = 5 * GiB, used: int = GiB) -> FakeGpu:
    """A MIG instance: its own memory; utilisation, temperature and power unsupported, as
    NVML says of MIG devices."""
    unsupported = ("nvmlDeviceGetUtilizationRates", "nvmlDeviceGetTemperature",
                   "nvmlDeviceGetPowerUsage")  # fmt: skip
    return FakeGpu(
        name="NVIDIA A100-SXM4-40GB MIG 1g.5gb", total=total, used=used, uuid=uuid,
        errors=dict.fromkeys(unsupported, pynvml.NVMLError_NotSupported),
    )  # fmt: skip


class FakeNvml:
    """Stands in for the `pynvml` module: same function names, the real NVMLError classes."""

    NVML_TEMPERATURE_GPU = pynvml.NVML_TEMPERATURE_GPU
    NVML_DEVICE_MIG_ENABLE = pynvml.NVML_DEVICE_MIG_ENABLE
    NVML_DEVICE_MIG_DISABLE = pynvml.NVML_DEVICE_MIG_DISABLE

    def __init__(self, *gpus: FakeGpu) -> None:
        self.gpus = list(gpus)
        for index, gpu in enumerate(self.gpus):
            gpu.uuid = gpu.uuid or f"GPU-fake-{index}"
            gpu.pci_bus_id = gpu.pci_bus_id or f"00000000:{index:02X}:00.0"
        self.driver_loaded = True
        self.initialised = False
        self.init_calls = 0
        self.shutdown_calls = 0

    def __getattr__(self, name: str) -> Any:
        if name.startswith("NVMLError"):
            return getattr(pynvml, name)  # NVMLError and every NVMLError_* subclass
        raise AttributeError(name)

    def _ready(self) -> None:
        if not self.driver_loaded:
            raise pynvml.NVMLError_DriverNotLoaded()
        if not self.initialised:
            raise pynvml.NVMLError_Uninitialized()

    def _gpu(self, handle: Handle, fn: str) -> FakeGpu:
        """The device of `handle`: an index, or (index, slot) for a MIG instance."""
        self._ready()
        if isinstance(handle, tuple):
            parent = self.gpus[handle[0]]
            assert parent.migs is not None
            gpu = parent.migs[handle[1]]
        else:
            gpu = self.gpus[handle]
        if gpu.lost:
            raise pynvml.NVMLError_GpuIsLost()
        if fn in gpu.errors:
            raise gpu.errors[fn]()
        return gpu

    def nvmlInit(self) -> None:
        self.init_calls += 1
        if not self.driver_loaded:
            raise pynvml.NVMLError_DriverNotLoaded()
        self.initialised = True

    def nvmlShutdown(self) -> None:
        self.shutdown_calls += 1
        self._ready()
        self.initialised = False

    def nvmlSystemGetDriverVersion(self) -> str:
        self._ready()
        return "550.54.15"

    def nvmlDeviceGetCount(self) -> int:
        self._ready()
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        self._ready()
        if not 0 <= index < len(self.gpus):
            raise pynvml.NVMLError_InvalidArgument()
        self._gpu(index, "nvmlDeviceGetHandleByIndex")
        return index

    def nvmlDeviceGetUUID(self, handle: Handle) -> str:
        return self._gpu(handle, "nvmlDeviceGetUUID").uuid

    def nvmlDeviceGetPciInfo(self, handle: int) -> SimpleNamespace:
        return SimpleNamespace(busId=self._gpu(handle, "nvmlDeviceGetPciInfo").pci_bus_id)

    def nvmlDeviceGetMigMode(self, handle: int) -> list[int]:
        on = self._gpu(handle, "nvmlDeviceGetMigMode").migs is not None
        mode = pynvml.NVML_DEVICE_MIG_ENABLE if on else pynvml.NVML_DEVICE_MIG_DISABLE
        return [mode, mode]

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: int) -> int:
        self._gpu(handle, "nvmlDeviceGetMaxMigDeviceCount")
        return 7

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: int, slot: int) -> tuple[int, int]:
        migs = self._gpu(handle, "nvmlDeviceGetMigDeviceHandleByIndex").migs or []
        if slot >= len(migs):
            raise pynvml.NVMLError_NotFound()
        return (handle, slot)

    def nvmlDeviceGetName(self, handle: Handle) -> str:
        return self._gpu(handle, "nvmlDeviceGetName").name

    def nvmlDeviceGetMemoryInfo(self, handle: Handle) -> SimpleNamespace:
        gpu = self._gpu(handle, "nvmlDeviceGetMemoryInfo")
        return SimpleNamespace(total=gpu.total, used=gpu.used, free=gpu.total - gpu.used)

    def nvmlDeviceGetUtilizationRates(self, handle: Handle) -> SimpleNamespace:
        gpu = self._gpu(handle, "nvmlDeviceGetUtilizationRates")
        return SimpleNamespace(gpu=gpu.util_gpu, memory=gpu.util_memory)

    def nvmlDeviceGetTemperature(self, handle: Handle, sensor: int) -> int:
        assert sensor == pynvml.NVML_TEMPERATURE_GPU
        return self._gpu(handle, "nvmlDeviceGetTemperature").temperature

    def nvmlDeviceGetPowerUsage(self, handle: Handle) -> int:
        return self._gpu(handle, "nvmlDeviceGetPowerUsage").power_mw

    def nvmlDeviceGetComputeRunningProcesses(self, handle: Handle) -> list[SimpleNamespace]:
        gpu = self._gpu(handle, "nvmlDeviceGetComputeRunningProcesses")
        return [SimpleNamespace(pid=pid, usedGpuMemory=mem) for pid, mem in gpu.processes]


@pytest.fixture(autouse=True)
def no_devices_given(monkeypatch: pytest.MonkeyPatch) -> None:
    """A probe reads what this test gives it, not a CUDA_VISIBLE_DEVICES of the machine's."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)


@pytest.fixture
def log() -> logging.Logger:
    return logging.getLogger("test.gpu")


def records(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "test.gpu" and r.levelno == level]


def test_the_fake_uses_only_names_the_real_pynvml_has() -> None:
    for name in dir(FakeNvml):
        if name.startswith(("nvml", "NVML_")):
            assert hasattr(pynvml, name), name
    for name in ("NVMLError_GpuIsLost", "NVMLError_NotSupported", "NVMLError_DriverNotLoaded"):
        assert issubclass(getattr(FakeNvml(), name), pynvml.NVMLError)


def test_nvml_probe_reads_every_device(log: logging.Logger) -> None:
    nvml = FakeNvml(FakeGpu(), FakeGpu(name="NVIDIA L4", total=24 * GiB, used=GiB, processes=[]))
    gpu = NvmlProbe(nvml, clock=ManualClock(), log=log)

    first, second = gpu.sample()

    assert gpu.available and gpu.status == "NVML: 2 device(s)"
    assert nvml.init_calls == 1
    assert first.index == 0 and first.name == "NVIDIA A100-SXM4-40GB"
    assert (first.memory_total, first.memory_used, first.memory_free) == (
        40 * GiB,
        10 * GiB,
        30 * GiB,
    )
    assert (first.utilization_gpu, first.utilization_memory) == (80, 40)
    assert first.temperature == 65 and first.power_w == 250.0
    assert [(p.pid, p.used_memory) for p in first.processes] == [(4242, 9 * GiB)]
    assert second.index == 1 and second.name == "NVIDIA L4" and second.processes == ()
    gpu.sample()
    assert nvml.init_calls == 1  # initialised once, not per sample


def test_values_a_device_does_not_support_are_none(log: logging.Logger) -> None:
    unsupported = {
        fn: pynvml.NVMLError_NotSupported
        for fn in (
            "nvmlDeviceGetUtilizationRates",
            "nvmlDeviceGetTemperature",
            "nvmlDeviceGetPowerUsage",
        )
    }
    unsupported["nvmlDeviceGetComputeRunningProcesses"] = pynvml.NVMLError_NoPermission
    gpu = NvmlProbe(FakeNvml(FakeGpu(errors=unsupported)), clock=ManualClock(), log=log)

    (device,) = gpu.sample()

    assert device.memory_used == 10 * GiB
    assert device.utilization_gpu is None and device.utilization_memory is None
    assert device.temperature is None and device.power_w is None
    assert device.processes == ()


def test_a_gpu_lost_mid_run_is_skipped_and_logged_once(
    log: logging.Logger, caplog: pytest.LogCaptureFixture
) -> None:
    nvml = FakeNvml(FakeGpu(), FakeGpu())
    gpu = NvmlProbe(nvml, clock=ManualClock(), log=log)
    assert len(gpu.sample()) == 2

    nvml.gpus[1].lost = True
    with caplog.at_level(logging.INFO):
        readings = [gpu.sample() for _ in range(3)]
    assert all([d.index for d in r] == [0] for r in readings)
    assert records(caplog, logging.WARNING) == [
        "GPU 1 skipped: NVML error: GPU is lost (NVMLError_GpuIsLost)"
    ]
    assert gpu.available and "1 skipped" in gpu.status

    nvml.gpus[1].lost = False
    with caplog.at_level(logging.INFO):
        assert [d.index for d in gpu.sample()] == [0, 1]
    assert "GPU 1 is readable again" in records(caplog, logging.INFO)


def test_a_device_with_implausible_values_is_skipped(log: logging.Logger) -> None:
    gpu = NvmlProbe(FakeNvml(FakeGpu(temperature=5000), FakeGpu()), clock=ManualClock(), log=log)
    assert [d.index for d in gpu.sample()] == [1]


def test_driver_gone_mid_run_pauses_readings_and_reinit_brings_them_back(
    log: logging.Logger, caplog: pytest.LogCaptureFixture
) -> None:
    clock = ManualClock()
    nvml = FakeNvml(FakeGpu())
    gpu = NvmlProbe(nvml, clock=clock, log=log, retry=5.0, max_retry=60.0)
    assert gpu.sample()

    nvml.driver_loaded = False
    with caplog.at_level(logging.INFO):
        assert gpu.sample() == ()
        assert gpu.sample() == ()
        clock.advance(5.0)
        assert gpu.sample() == ()  # the first retry fails too
    assert not gpu.available
    assert gpu.status == "NVML unavailable: the NVIDIA driver is not loaded"
    warnings = records(caplog, logging.WARNING)
    assert len(warnings) == 1 and "the NVIDIA driver is not loaded" in warnings[0]
    assert nvml.init_calls == 2  # one retry after 5 s, none between

    nvml.driver_loaded = True
    clock.advance(9.9)
    assert gpu.sample() == ()  # the backoff doubled to 10 s
    assert nvml.init_calls == 2
    clock.advance(0.1)
    with caplog.at_level(logging.INFO):
        (device,) = gpu.sample()
    assert device.index == 0 and gpu.available and nvml.init_calls == 3
    assert any("available again" in m for m in records(caplog, logging.INFO))


def test_driver_errors_while_reading_a_device_pause_the_whole_probe(log: logging.Logger) -> None:
    clock = ManualClock()
    nvml = FakeNvml(
        FakeGpu(), FakeGpu(errors={"nvmlDeviceGetPowerUsage": pynvml.NVMLError_Uninitialized})
    )
    gpu = NvmlProbe(nvml, clock=clock, log=log, retry=1.0)
    assert gpu.sample() == ()
    assert not gpu.available and gpu.status == "NVML unavailable: NVML is not initialised"
    nvml.gpus[1].errors.clear()
    clock.advance(1.0)
    assert len(gpu.sample()) == 2


def test_probe_uses_nvml_when_it_initialises(log: logging.Logger) -> None:
    chosen = probe(log, nvml=FakeNvml(FakeGpu()), clock=ManualClock())
    assert isinstance(chosen, NvmlProbe) and chosen.available
    assert len(chosen.sample()) == 1
    chosen.close()
    assert chosen.sample() == () and not chosen.available


def test_probe_without_nvml_says_why(log: logging.Logger) -> None:
    nvml = FakeNvml(FakeGpu())
    nvml.driver_loaded = False
    chosen = probe(log, nvml=nvml, clock=ManualClock())
    assert isinstance(chosen, NoGpuProbe)
    assert chosen.status == "no GPU telemetry: the NVIDIA driver is not loaded"


def test_this_machine_without_a_gpu_says_so_once(
    log: logging.Logger, caplog: pytest.LogCaptureFixture
) -> None:
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        pass
    else:  # pragma: no cover - only on a machine with an NVIDIA driver
        pynvml.nvmlShutdown()
        pytest.skip("this machine has NVML")
    with caplog.at_level(logging.INFO):
        chosen: GpuProbe = probe(log)
        readings = [chosen.sample() for _ in range(3)]
    assert isinstance(chosen, NoGpuProbe) and not chosen.available
    assert readings == [(), (), ()]
    said = [r for r in caplog.records if r.name == "test.gpu"]
    assert len(said) == 1 and said[0].levelno == logging.INFO
    assert "NVML library not found: no NVIDIA driver on this machine" in said[0].getMessage()


# ---------------------------------------------------------------- one process, its own GPUs


def four_gpus() -> FakeNvml:
    return FakeNvml(*(FakeGpu(used=(1 + i) * GiB) for i in range(4)))


def test_a_process_given_one_gpu_by_uuid_reads_that_one_under_its_nvml_index(
    log: logging.Logger,
) -> None:
    nvml = four_gpus()
    gpu = NvmlProbe(nvml, clock=ManualClock(), log=log, env={"CUDA_VISIBLE_DEVICES": "GPU-fake-2"})

    (device,) = gpu.sample()

    assert device.index == 2 and device.memory_used == 3 * GiB
    assert gpu.status == "NVML: 1 device(s)"


def test_four_ranks_of_a_node_send_four_readings_not_sixteen(log: logging.Logger) -> None:
    nvml = four_gpus()
    readings = [
        NvmlProbe(nvml, clock=ManualClock(), log=log, env={"CUDA_VISIBLE_DEVICES": f"{i}"}).sample()
        for i in range(4)
    ]
    assert [[d.index for d in r] for r in readings] == [[0], [1], [2], [3]]


def test_a_process_given_a_mig_instance_reads_its_memory_alone(log: logging.Logger) -> None:
    nvml = FakeNvml(FakeGpu(), FakeGpu(migs=[mig("MIG-one"), mig("MIG-two", used=4 * GiB)]))
    gpu = NvmlProbe(nvml, clock=ManualClock(), log=log, env={"CUDA_VISIBLE_DEVICES": "MIG-two"})

    (device,) = gpu.sample()

    assert device.index == 1  # the GPU it is an instance of
    assert (device.memory_total, device.memory_used) == (5 * GiB, 4 * GiB)
    assert device.utilization_gpu is None and device.temperature is None


def test_a_process_given_a_gpu_nvml_does_not_see_reads_none_and_says_why_once(
    log: logging.Logger, caplog: pytest.LogCaptureFixture
) -> None:
    env = {"CUDA_VISIBLE_DEVICES": "GPU-elsewhere"}
    with caplog.at_level(logging.INFO):
        gpu = NvmlProbe(four_gpus(), clock=ManualClock(), log=log, env=env)
        readings = [gpu.sample() for _ in range(3)]
    assert readings == [(), (), ()]
    assert records(caplog, logging.WARNING) == [
        "GPU readings of this process: CUDA_VISIBLE_DEVICES entry 'GPU-elsewhere' names no "
        "device NVML sees"
    ]


def test_a_process_hidden_from_every_gpu_reads_none(log: logging.Logger) -> None:
    gpu = NvmlProbe(four_gpus(), clock=ManualClock(), log=log, env={"CUDA_VISIBLE_DEVICES": "-1"})
    assert gpu.sample() == () and gpu.available and gpu.status == "NVML: 0 device(s)"


def test_the_reading_carries_pytorch_s_cache_of_the_process_s_device(log: logging.Logger) -> None:
    asked: list[int] = []

    def cache(ordinal: int) -> int | None:
        asked.append(ordinal)
        return 6 * GiB

    env = {"CUDA_VISIBLE_DEVICES": "GPU-fake-3"}
    gpu = NvmlProbe(four_gpus(), clock=ManualClock(), log=log, env=env, cache=cache)
    (device,) = gpu.sample()
    assert device.memory_cached == 6 * GiB and asked == [0]  # its cuda:0


def test_without_torch_in_the_process_the_cache_is_unknown_and_torch_is_not_imported() -> None:
    """Run in a fresh interpreter: this test process may have imported torch already."""
    code = (
        "import sys\n"
        "from cohort.worker.telemetry.gpu import torch_cache\n"
        "assert torch_cache(0) is None\n"
        "assert 'torch' not in sys.modules, 'the telemetry imported torch'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_with_torch_but_no_cuda_context_the_cache_is_unknown_and_none_is_opened() -> None:
    torch = pytest.importorskip("torch")
    assert torch_cache(0) is None
    assert not torch.cuda.is_initialized()


class ScriptedProbe:
    """A probe that replays `script`: a tuple of devices, or an exception to raise."""

    available = True
    status = "scripted"

    def __init__(self, *script: tuple[GpuDevice, ...] | Exception) -> None:
        self.script = list(script)
        self.calls = 0

    def sample(self) -> tuple[GpuDevice, ...]:
        step = self.script[min(self.calls, len(self.script) - 1)]
        self.calls += 1
        if isinstance(step, Exception):
            raise step
        return step

    def close(self) -> None:
        pass


ONE = (GpuDevice(index=0, memory_total=100, memory_used=50),)


def test_sampler_samples_once_per_interval_and_sends_only_devices() -> None:
    clock = ManualClock()
    sent: list[tuple[GpuDevice, ...]] = []
    gpu = ScriptedProbe((), ONE)
    sampler = GpuSampler(gpu, sent.append, interval=5.0, stop=threading.Event(), clock=clock)

    assert sampler.tick() and sent == []  # nothing to report: nothing sent
    assert not sampler.tick() and gpu.calls == 1
    clock.advance(4.9)
    assert not sampler.tick()
    clock.advance(0.1)
    assert sampler.tick() and sent == [ONE]
    clock.advance(5.0)
    assert sampler.tick() and sent == [ONE, ONE]


def test_sampler_survives_a_probe_or_send_raising(
    log: logging.Logger, caplog: pytest.LogCaptureFixture
) -> None:
    clock = ManualClock()
    sent: list[tuple[GpuDevice, ...]] = []
    gpu = ScriptedProbe(RuntimeError("boom"), RuntimeError("boom"), ONE)
    sampler = GpuSampler(gpu, sent.append, 1.0, threading.Event(), clock=clock, log=log)
    with caplog.at_level(logging.INFO):
        for _ in range(3):
            sampler.tick()
            clock.advance(1.0)
    assert sent == [ONE]
    assert len(records(caplog, logging.ERROR)) == 1  # the same error twice is logged once

    def refuse(devices: tuple[GpuDevice, ...]) -> None:
        raise ConnectionError("redis is down")

    sampler.send = refuse
    sampler.tick()  # does not raise


def test_sampler_thread_sends_until_stopped() -> None:
    stop = threading.Event()
    got_three = threading.Event()
    sent: list[tuple[GpuDevice, ...]] = []

    def send(devices: tuple[GpuDevice, ...]) -> None:
        sent.append(devices)
        if len(sent) >= 3:
            got_three.set()

    gpu = ScriptedProbe(RuntimeError("first sample fails"), ONE)
    sampler = GpuSampler(gpu, send, interval=0.01, stop=stop)
    thread = sampler.start()
    assert got_three.wait(5.0), "the sampler thread did not send three readings"
    stop.set()
    thread.join(5.0)
    assert not thread.is_alive()
    assert sent[:3] == [ONE, ONE, ONE]


def test_sampler_rejects_a_non_positive_interval() -> None:
    with pytest.raises(ValueError, match="interval must be positive, got 0"):
        GpuSampler(ScriptedProbe(ONE), print, 0, threading.Event())
