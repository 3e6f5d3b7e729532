"""Train a Hugging Face causal LM with autopar, end to end.

    torchrun --nproc-per-node 2 examples/train_hf.py --mesh tp=2 --steps 20
    autopar plan --model gpt3-175b --cluster 128x8 --hardware a100 --batch 1536 --seq 2048 --dtype fp16 --save-plan plan.json
    torchrun --nproc-per-node 2 examples/train_hf.py --plan plan.json --steps 20 --ckpt-dir ckpt --ckpt-every 10
    torchrun --nproc-per-node 2 examples/train_hf.py --plan plan.json --steps 30 --ckpt-dir ckpt --resume

The model is ``transformers``' own, built from a config: ``--config`` names a directory with a
``config.json`` (read locally, nothing is downloaded), a config autopar ships
(``llama3-8b``, ``mixtral-8x7b``, ... in ``autopar/models/configs/``) or a model type
(``llama``, ``qwen2``, ``gpt2``, ...) at the library's defaults; ``--set key=value`` overrides fields (the defaults
make it tiny). The same script runs on CPUs (gloo) and on GPUs (NCCL, one GPU per rank);
everything else is in ``examples/_common.py``.
"""
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import VOCAB, arguments, init, train  # noqa: E402

TINY = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 128, "max_position_embeddings": 256}


def build(spec: str, sets: list[str]) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    from autopar.models.hf import CONFIGS_DIR
    path = Path(spec) if (Path(spec) / "config.json").is_file() else CONFIGS_DIR / spec
    if (path / "config.json").is_file():
        settings = json.loads((path / "config.json").read_text())
        kind = settings.pop("model_type")
    else:
        settings, kind = {}, spec
    for item in sets:
        key, _, value = item.partition("=")
        settings[key] = json.loads(value) if value[:1].isdigit() or value in ("true", "false") else value
    settings = {k: v for k, v in settings.items() if k not in ("architectures", "transformers_version")}
    ids = {"bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}          # inside the byte vocabulary
    config = AutoConfig.for_model(kind, **{**settings, "vocab_size": VOCAB, **ids})
    return AutoModelForCausalLM.from_config(config)


if __name__ == "__main__":
    ap = arguments(__doc__.splitlines()[0], default_mesh="tp=2")
    ap.add_argument("--config", default="llama", help="a directory holding config.json, a config autopar ships "
                    "(llama3-8b, qwen1.5-moe-a2.7b, ...), or a model type (llama, qwen2, gpt2, ...)")
    ap.add_argument("--set", action="append", default=[f"{k}={v}" for k, v in TINY.items()],
                    metavar="KEY=VALUE", help="config field overrides (defaults: a tiny model)")
    args = ap.parse_args()
    device = init()
    torch.manual_seed(args.seed)          # the same weights on every rank (rank 0's are broadcast anyway)
    train(build(args.config, args.set), args, device)
