"""Mean beta (and decay factor a) of each head and layer at key, value and query positions of a trained recall
model, over 256 validation sequences. An analysis script, not part of the package:

    PYTHONPATH=src python docs/results/recall64/beta_probe.py RUN_DIR   # a run of `attnzoo train recall`
"""
import sys, torch
from pathlib import Path
from attnzoo.training.checkpoint import read_config, load_weights, find_checkpoint
from attnzoo.training.config import TrainConfig
from attnzoo.training.model import build_model
from attnzoo import tasks
from attnzoo.mechanisms.delta import _DeltaRuleMechanism
torch.set_num_threads(1)
run = Path(sys.argv[1])
ck = find_checkpoint(run / 'checkpoints')
cfg = read_config(ck)
tc = TrainConfig(**cfg['train'])
task = tasks.load(tc.task, **tc.task_options)
model = build_model(tc, task); load_weights(ck, model); model.eval()
records = []
def hook(mod, args, kwargs):
    q, k = args[0], args[1]
    _, _, beta, log_decay = mod._gated_inputs(q, k, None)
    records.append((beta, None if log_decay is None else log_decay.exp()))
for m in model.modules():
    if isinstance(m, _DeltaRuleMechanism):
        m.register_forward_pre_hook(hook, with_kwargs=True)
split = task.split('validation')
with torch.no_grad():
    model(split.inputs[:256])
P = task.num_pairs
kinds = {'key': slice(0, 2*P, 2), 'value': slice(1, 2*P, 2), 'query': slice(2*P, None)}
for layer, (beta, a) in enumerate(records):
    line = [f"layer {layer}"]
    for name, s in kinds.items():
        b = beta[:, :, s].mean(dim=(0, 2))
        line.append(f"beta@{name} " + " ".join(f"{x:.2f}" for x in b.tolist()))
        if a is not None:
            line.append(f"a@{name} " + " ".join(f"{x:.3f}" for x in a[:, :, s].mean(dim=(0, 2)).tolist()))
    print(" | ".join(line))
