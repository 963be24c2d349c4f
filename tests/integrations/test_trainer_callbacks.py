"""Resuming through a trainer's own checkpoints is bitwise exact with
onebit.callbacks (issue 32 item 3), and without them the optimizer warns
once that its error feedback restarted.

Each trainer runs as a real 2-rank torchrun job: 8 steps of OnebitAdam
(1-bit from step 3) with a checkpoint at step 5, then a second job resumes
from that checkpoint to step 8. The resumed parameters must equal the
uninterrupted job's bit for bit; a resume without the callback must not
(the error feedback matters) and must say so."""
import subprocess
import sys

import pytest
import torch


COMMON = """
import os, sys, warnings
import torch
import torch.distributed as dist
import onebit

out, tag, resume, with_callback = sys.argv[1], sys.argv[2], sys.argv[3] == "1", sys.argv[4] == "1"
torch.manual_seed(0)
# 8 rows repeated 5 times: each rank sees the same 4 rows in every batch,
# so a resume is exact whatever the trainer does with the data position
# (Lightning restarts an epoch's loader from its start).
data = torch.randn(8, 8).repeat(5, 1)
target = data.sum(1).tanh()


def finish(model, caught):
    rank = dist.get_rank()
    torch.save(model.state_dict(), os.path.join(out, f"{tag}.rank{rank}.pt"))
    restarted = [w for w in caught if "restarted from zero" in str(w.message)]
    print(f"rank {rank} warnings {len(restarted)}", flush=True)
    # The trainers' own DDP collectives (torch's, not onebit's) can abort a
    # process at interpreter exit, about once in 30 jobs (docs/faults.md,
    # pytorch/pytorch#190489). The results are on disk and flushed, so leave
    # without finalizing once both ranks are here.
    dist.barrier()
    os._exit(0)
"""

HF_SCRIPT = COMMON + """
from transformers import Trainer, TrainingArguments
from onebit.callbacks.hf import ErrorFeedbackCallback

dist.init_process_group("gloo")


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

    def forward(self, x, labels):
        return {"loss": torch.nn.functional.mse_loss(self.body(x).squeeze(-1), labels)}


class Rows(torch.utils.data.Dataset):
    def __len__(self):
        return len(target)

    def __getitem__(self, i):
        return {"x": data[i], "labels": target[i]}


model = Net()
opt = onebit.OnebitAdam(model.parameters(), lr=1e-2, freeze_step=2)
args = TrainingArguments(output_dir=os.path.join(out, "hf"), max_steps=8, per_device_train_batch_size=4,
                         save_strategy="steps", save_steps=5, report_to=[], use_cpu=True,
                         disable_tqdm=True, logging_steps=100, seed=0)
trainer = Trainer(model=model, args=args, train_dataset=Rows(), optimizers=(opt, None),
                  callbacks=[ErrorFeedbackCallback()] if with_callback else [])
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    trainer.train(resume_from_checkpoint=os.path.join(out, "hf", "checkpoint-5") if resume else None)
finish(model, caught)
"""

LIGHTNING_SCRIPT = COMMON + """
import lightning
from lightning.pytorch.callbacks import ModelCheckpoint
from onebit.callbacks.lightning import ErrorFeedbackCallback


class Net(lightning.LightningModule):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

    def training_step(self, batch, i):
        x, y = batch
        return torch.nn.functional.mse_loss(self.body(x).squeeze(-1), y)

    def configure_optimizers(self):
        return onebit.OnebitAdam(self.parameters(), lr=1e-2, freeze_step=2)


model = Net()
saves = ModelCheckpoint(dirpath=os.path.join(out, "pl"), every_n_epochs=1, save_top_k=-1)
callbacks = [saves] + ([ErrorFeedbackCallback()] if with_callback else [])
trainer = lightning.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=8,
                            callbacks=callbacks, logger=False, enable_progress_bar=False,
                            enable_model_summary=False, use_distributed_sampler=False)
# Not shuffled (Lightning's own sampler shuffles), so every batch of a rank is the same.
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data, target), batch_size=4,
                                     sampler=torch.utils.data.DistributedSampler(
                                         torch.utils.data.TensorDataset(data, target), shuffle=False,
                                         num_replicas=2, rank=int(os.environ["RANK"])))
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    trainer.fit(model, loader,
                ckpt_path=os.path.join(out, "pl", "epoch=0-step=5.ckpt") if resume else None)
finish(model, caught)
"""


def _torchrun(script_path, port, *argv, ranks=2):
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
                           "--master-port", str(port), str(script_path), *argv],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def _params(out, tag, rank):
    return torch.load(out / f"{tag}.rank{rank}.pt", weights_only=True)


def _check_resume(tmp_path, script, port):
    path = tmp_path / "job.py"
    path.write_text(script)
    _torchrun(path, port, str(tmp_path), "full", "0", "1")
    resumed = _torchrun(path, port + 1, str(tmp_path), "resumed", "1", "1")
    plain = _torchrun(path, port + 2, str(tmp_path), "plain", "1", "0")
    for rank in (0, 1):
        full = _params(tmp_path, "full", rank)
        assert all(torch.equal(full[k], v) for k, v in _params(tmp_path, "resumed", rank).items())
        # Both ranks hold the same parameters.
        assert all(torch.equal(full[k], v) for k, v in _params(tmp_path, "full", 1 - rank).items())
        # Without the callback the error feedback restarts, and it shows.
        assert any(not torch.equal(full[k], v) for k, v in _params(tmp_path, "plain", rank).items())
    assert resumed.count("warnings 0") == 2, resumed
    assert plain.count("warnings 1") == 2, plain


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_hugging_face_trainer_resume_is_bitwise_exact_with_the_callback(tmp_path):
    pytest.importorskip("transformers")
    _check_resume(tmp_path, HF_SCRIPT, 29650)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_lightning_resume_is_bitwise_exact_with_the_callback(tmp_path):
    pytest.importorskip("lightning")
    _check_resume(tmp_path, LIGHTNING_SCRIPT, 29660)


# FSDP2 through Lightning's ModelParallelStrategy (issue 43): 4 ranks as 2
# replicas x 2 shards, the mesh built in configure_model, DCP checkpoints.
# Each shard's error buffers must come back, not only the first shard's.
LIGHTNING_SHARDED_SCRIPT = COMMON + """
import lightning
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from onebit.callbacks.lightning import ErrorFeedbackCallback

# 16 rows: each of the 4 ranks sees its own 4.
data = torch.randn(16, 8).repeat(5, 1)
target = data.sum(1).tanh()


class Net(lightning.LightningModule):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

    def configure_model(self):
        self.mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        fully_shard(self.body, mesh=self.mesh["shard"])

    def training_step(self, batch, i):
        x, y = batch
        return torch.nn.functional.mse_loss(self.body(x).squeeze(-1), y)

    def configure_optimizers(self):
        return onebit.OnebitAdam(self.parameters(), lr=1e-2, freeze_step=2,
                                 process_group=self.mesh.get_group("replicate"))


model = Net()
saves = ModelCheckpoint(dirpath=os.path.join(out, "pl"), every_n_epochs=1, save_top_k=-1)
callback = ErrorFeedbackCallback()
trainer = lightning.Trainer(accelerator="cpu", devices=4, max_steps=8,
                            strategy=ModelParallelStrategy(data_parallel_size=4, tensor_parallel_size=1),
                            callbacks=[saves, callback], logger=False, enable_progress_bar=False,
                            enable_model_summary=False, use_distributed_sampler=False)
rows = torch.utils.data.TensorDataset(data, target)
loader = torch.utils.data.DataLoader(rows, batch_size=4, sampler=torch.utils.data.DistributedSampler(
    rows, shuffle=False, num_replicas=4, rank=int(os.environ["RANK"])))
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    trainer.fit(model, loader,
                ckpt_path=os.path.join(out, "pl", "epoch=0-step=5.ckpt") if resume else None)
print(f"rank {dist.get_rank()} restored {callback.restored}", flush=True)


class Whole:  # what finish() saves: the whole params, gathered over the shards

    def state_dict(self):
        return {k: v.full_tensor() for k, v in model.state_dict().items()}


finish(Whole(), caught)
"""


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_lightning_fsdp2_resume_is_bitwise_exact_on_every_shard(tmp_path):
    """Before the callbacks gathered over the whole job, the second shard's
    buffers were missing from the checkpoint: its params then differed by
    up to 10 after three steps."""
    pytest.importorskip("lightning")
    path = tmp_path / "job.py"
    path.write_text(LIGHTNING_SHARDED_SCRIPT)
    _torchrun(path, 29670, str(tmp_path), "full", "0", "1", ranks=4)
    resumed = _torchrun(path, 29671, str(tmp_path), "resumed", "1", "1", ranks=4)
    assert resumed.count("restored True") == 4, resumed
    assert resumed.count("warnings 0") == 4, resumed
    full = _params(tmp_path, "full", 0)
    for rank in range(4):
        for tag in ("full", "resumed"):
            assert all(torch.equal(full[k], v) for k, v in _params(tmp_path, tag, rank).items())
