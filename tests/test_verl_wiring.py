"""verl's legacy trainer (``trainer.use_v1=False``) wired for real: the docs' ``probe_verl.py``
(its code block in docs/ingest.md, unchanged but for the log directory) runs as a script, so
its classes live in ``__main__``, through verl 0.9.1's own ``main_ppo.main()`` (Hydra, its
default config, a tiny model and a four-prompt dataset), on a one-CPU Ray started by verl's
``run_ppo``. Ray ships verl's ``TaskRunner`` to its actor; ``TaskRunner.run`` reads the
dataset and builds its trainer there. One Ray worker setup hook, this test's only addition,
stops the run at ``init_workers``, the first step that needs GPUs, naming the trainer the task
runner built and its writer.

This is the mechanism that broke: with the recipe this replaced (a task runner subclass that
set ``main_ppo_v0.RayPPOTrainer`` inside its ``run``, in the actor), the same run built verl's
own ``RayPPOTrainer`` (``BUILT verl.trainer.ppo.ray_trainer.RayPPOTrainer``): the actor's
``run`` reads the copy of its globals that Ray pickled with the class.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

DOCS = Path(__file__).resolve().parents[1] / "docs" / "ingest.md"

# Imported by every Ray worker of the run before it takes work (``worker_process_setup_hook``):
# the trainer's first GPU step reports what was built, and ends the run.
STOP_HOOK = """
def stop_at_init_workers():
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    def init_workers(self):
        cls, probe = type(self), getattr(self, "probe", None)
        where = getattr(probe, "root", None)
        raise RuntimeError(f"BUILT {cls.__module__}.{cls.__qualname__} "
                           f"writer={type(probe).__name__} root={where}")

    RayPPOTrainer.init_workers = init_workers
"""


def docs_block(marker: str) -> str:
    text = DOCS.read_text()
    return next(b for b in re.findall(r"```python\n(.*?)```", text, re.S) if marker in b)


def test_the_docs_verl_script_builds_the_probe_trainer_in_the_task_runner(
    tiny_model: Path, tmp_path: Path
) -> None:
    logs = tmp_path / "probe_logs"
    script = docs_block("class ProbeTaskRunnerV1")
    assert '"/data/probe_logs"' in script
    (tmp_path / "probe_verl.py").write_text(script.replace('"/data/probe_logs"', repr(str(logs))))
    (tmp_path / "verl_stop.py").write_text(STOP_HOOK)
    prompts = [
        {
            "data_source": "probe",
            "prompt": [{"role": "user", "content": f"What is {i} + {i}?"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
            "extra_info": {"index": i},
        }
        for i in range(4)
    ]
    data = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(prompts), data)
    overrides = [
        "trainer.use_v1=False",
        f"data.train_files={data}",
        f"data.val_files={data}",
        "data.train_batch_size=2",
        "data.max_prompt_length=64",
        "data.max_response_length=16",
        "algorithm.adv_estimator=grpo",
        f"actor_rollout_ref.model.path={tiny_model}",
        f"critic.model.path={tiny_model}",
        "actor_rollout_ref.rollout.calculate_log_probs=True",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=1",
        "trainer.n_gpus_per_node=1",
        "trainer.nnodes=1",
        "trainer.logger=[console]",
        "+ray_kwargs.ray_init.num_cpus=1",
        "+ray_kwargs.ray_init.include_dashboard=False",
        "+ray_kwargs.ray_init.runtime_env.worker_process_setup_hook=verl_stop.stop_at_init_workers",
        f"hydra.run.dir={tmp_path / 'hydra'}",
        "hydra.output_subdir=null",
    ]
    path = os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env = {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1", "RAY_DEDUP_LOGS": "0"}
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    proc = subprocess.run(
        [sys.executable, "probe_verl.py", *overrides],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = proc.stdout + proc.stderr
    built = re.findall(r"BUILT (\S+) writer=(\S+) root=(\S+)", out)
    assert built, out[-4000:]
    # the probe's class (pickled by value from __main__), built in the actor, with its writer
    assert built[-1] == ("__main__.ProbeV0Trainer", "ProbeWriter", str(logs)), out[-4000:]
    assert proc.returncode != 0  # the stop hook ended the run, as it should
