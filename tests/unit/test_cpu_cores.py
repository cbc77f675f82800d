"""CPU core sets (`engine.local.cpu_cores`, `trainer.cpu_cores`): parsing, refusals and pinning."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tir_rl.engine import VLLMLocalEngine
from tir_rl.errors import ConfigError
from tir_rl.process import cpu_cores
from tir_rl.trainer import Trainer


@pytest.fixture
def four_cores(monkeypatch):
    monkeypatch.setattr(cpu_cores, "available_cores", lambda: frozenset(range(4)))


def test_a_cpu_list_parses_single_ids_and_ranges_and_formats_back(four_cores):
    cores = cpu_cores.parse_cpu_list("0, 2-3", setting="x")
    assert cores == {0, 2, 3}
    assert cpu_cores.format_cpu_list(cores) == "0,2-3"
    assert cpu_cores.format_cpu_list(frozenset({0, 1, 2, 5})) == "0-2,5"


@pytest.mark.parametrize(
    ("text", "said"),
    [("a", "not a CPU list"), ("3-1", "empty or negative"), ("0,7", "core(s) [7]")],
)
def test_a_bad_cpu_list_is_refused_with_the_setting_named(four_cores, text, said):
    with pytest.raises(ConfigError, match="trainer.cpu_cores") as error:
        Trainer.Config(cpu_cores=text).validate()
    assert said in str(error.value)
    with pytest.raises(ConfigError, match="engine.local.cpu_cores"):
        VLLMLocalEngine.Config(model_path="tiny", cpu_cores=text).validate()


def test_a_cuda_trainer_refuses_cpu_pinning(four_cores):
    from tir_rl.trainer.placement import _pin_to_cores

    with pytest.raises(ConfigError, match="pins a CPU trainer"):
        _pin_to_cores(__import__("torch").device("cuda"), "1")


_PIN_CHILD = """
import json, os, threading, time
from pathlib import Path
from tir_rl.process.cpu_cores import pin_process, restored_affinity
before = sorted(os.sched_getaffinity(0))
with restored_affinity():
    pin_process(frozenset({min(before)}))
after_block = sorted(os.sched_getaffinity(0))
stop = threading.Event()
worker = threading.Thread(target=stop.wait)  # a thread that exists before the pin
worker.start()
core = min(os.sched_getaffinity(0))
pin_process(frozenset({core}))
late = threading.Thread(target=stop.wait)  # and one started after it
late.start()
masks = [sorted(os.sched_getaffinity(int(t.name))) for t in Path("/proc/self/task").iterdir()]
stop.set()
print(json.dumps({"core": core, "masks": masks, "before": before, "after": after_block}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="pinning is Linux-only")
def test_pinning_moves_every_thread_of_the_process_and_those_started_later():
    out = subprocess.run(
        [sys.executable, "-c", _PIN_CHILD], capture_output=True, text=True, check=True
    ).stdout
    result = json.loads(out)
    assert len(result["masks"]) >= 3
    assert all(mask == [result["core"]] for mask in result["masks"]), result
    assert result["after"] == result["before"]  # restored_affinity gave the cores back
