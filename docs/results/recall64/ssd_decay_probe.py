"""Mean decay factor a per head and layer of a trained `ssd` recall model over 256 validation sequences, and
its geometric mean over 128 positions. An analysis script, not part of the package:

    PYTHONPATH=src python docs/results/recall64/ssd_decay_probe.py RUN_DIR
"""
import sys, torch
from pathlib import Path
from attnzoo.training.checkpoint import read_config, load_weights, find_checkpoint
from attnzoo.training.config import TrainConfig
from attnzoo.training.model import build_model
from attnzoo import tasks
from attnzoo.mechanisms.ssd import StateSpaceDualityAttention
torch.set_num_threads(1)
run = Path(sys.argv[1]); ck = find_checkpoint(run / 'checkpoints'); cfg = read_config(ck)
tc = TrainConfig(**cfg['train']); task = tasks.load(tc.task, **tc.task_options)
model = build_model(tc, task); load_weights(ck, model); model.eval()
rec = []
def hook(mod, args, kwargs):
    dt = mod.step_size(args[1]); rec.append(torch.exp(dt * -torch.exp(mod.A_log).unsqueeze(-1)))
for m in model.modules():
    if isinstance(m, StateSpaceDualityAttention): m.register_forward_pre_hook(hook, with_kwargs=True)
with torch.no_grad(): model(task.split('validation').inputs[:256])
for i, a in enumerate(rec):
    print(f"layer {i} mean a per head", " ".join(f"{x:.3f}" for x in a.mean(dim=(0, 2)).tolist()),
          "| a^128 (geometric mean)", " ".join(f"{x:.2e}" for x in a.log().mean(dim=(0, 2)).mul(128).exp().tolist()))
