"""Train a tiny Hugging Face Llama with autopar on 2 ranks, each step's loss beside the
single-process loss. Run with

    torchrun --nproc-per-node 2 examples/hf_causal_lm.py            # tensor axis: {"tp": 2}
    torchrun --nproc-per-node 2 examples/hf_causal_lm.py dp          # data axis, ZeRO-3
    torchrun --nproc-per-node 2 examples/hf_causal_lm.py pp          # two pipeline stages
"""
import copy
import sys

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

import autopar

layout = sys.argv[1] if len(sys.argv) > 1 else "tp"
dist.init_process_group("gloo")              # "nccl" with the model and batch on cuda
torch.manual_seed(0)                         # same weights everywhere (rank 0's are broadcast anyway)
config = LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                     intermediate_size=128, vocab_size=256, max_position_embeddings=64)
model = LlamaForCausalLM(config)             # as transformers builds it: use_cache on, no wrapper
reference = copy.deepcopy(model)
ids = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(1))
batch = {"input_ids": ids, "labels": ids}    # the model computes its own loss from labels

if layout == "dp":                           # each data rank passes its share of the batch
    mine = {k: v.chunk(2)[dist.get_rank()] for k, v in batch.items()}
    pm = autopar.parallelize(model, {"dp": 2}, example_kwargs=mine, zero_stage=3)
elif layout == "pp":
    mine = batch
    pm = autopar.parallelize(model, {"pp": 2}, example_kwargs=mine,
                                 options=autopar.PipelineOptions(schedule="1f1b", microbatches=2))
else:
    mine = batch
    pm = autopar.parallelize(model, {"tp": 2}, example_kwargs=mine)
opt = autopar.optimizer(pm, torch.optim.SGD, lr=0.1, momentum=0.9)
ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
for step in range(3):
    if layout == "pp":
        loss = pm.step(**mine)               # forward and backward of every micro-batch
    else:
        out = pm(**mine)                     # a CausalLMOutputWithPast, as the model returns
        out.loss.backward()
        loss = out.loss.detach()
    opt.step()
    opt.zero_grad()
    loss = loss.clone()
    dist.all_reduce(loss)
    loss /= dist.get_world_size()
    want = reference(**batch).loss
    want.backward()
    ref_opt.step()
    ref_opt.zero_grad()
    if dist.get_rank() == 0:
        print(f"step {step}: loss {loss.item():.6f}  single-process {want.item():.6f}")
dist.destroy_process_group()
