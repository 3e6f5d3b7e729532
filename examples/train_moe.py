"""Train a Hugging Face mixture-of-experts model (Mixtral, dropless, as transformers builds
it) with its experts spread over an expert axis.

    torchrun --nproc-per-node 2 examples/train_moe.py --mesh ep=2 --steps 20
    torchrun --nproc-per-node 4 examples/train_moe.py --mesh dp=2,ep=2 --zero 1
    torchrun --nproc-per-node 2 examples/train_moe.py --plan plan.json     # from autopar plan --save-plan

Every expert-axis rank routes its own rows: the data sampler gives each dp x ep rank a share.
Everything else (schedule, clipping, checkpoints, resume) is ``examples/_common.py``.
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import VOCAB, arguments, init, train  # noqa: E402


def build(experts: int, top_k: int) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, MixtralConfig
    config = MixtralConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, intermediate_size=96, max_position_embeddings=256,
                           num_local_experts=experts, num_experts_per_tok=top_k,
                           bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return AutoModelForCausalLM.from_config(config)


if __name__ == "__main__":
    ap = arguments(__doc__.splitlines()[0], default_mesh="ep=2")
    ap.add_argument("--experts", type=int, default=4)
    ap.add_argument("--top-k", type=int, default=2)
    args = ap.parse_args()
    device = init()
    torch.manual_seed(args.seed)
    train(build(args.experts, args.top_k), args, device)
