"""gpt-oss on 4 simulated CPU devices, run by ``tests/test_gpt_oss.py`` in a subprocess: the
tiny MXFP4 checkpoint loaded straight into ``tp=2, ep=2`` shards (the MXFP4 groups of 32 read
per shard, the down projection's split across a group) gives the one-device logits, and the
engine on that mesh (sinks split over heads, biased experts split over ``ep`` and ``tp``)
gives transformers' greedy tokens.

Usage: ``python tests/_gpt_oss_worker.py OUT.json``.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from paxcache import Engine, SamplingParams  # noqa: E402
from paxcache.models import load_model, load_pretrained  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from hf_gpt_oss_reference import (  # noqa: E402
    GENERATE,
    IDS,
    gpt_oss_config,
    random_gpt_oss_tensors,
    write_checkpoint,
)


def main(out: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        cfg = gpt_oss_config()
        path = write_checkpoint(Path(tmp), cfg, random_gpt_oss_tensors(cfg, 2, "mxfp4"))
        one = np.asarray(load_model(path)(jnp.asarray([IDS])))
        model, tok = load_pretrained(path, tp=2, ep=2)
        shard = model.layers.expert_down[...].addressable_shards[0].data.shape
        sharded = np.asarray(model(jnp.asarray([IDS])))
        engine = Engine(model, tok, num_blocks=16, block_size=4, max_num_seqs=1,
                        max_num_batched_tokens=8, tp=2, ep=2, warmup=False)  # fmt: skip
        params = SamplingParams(temperature=0.0, max_tokens=GENERATE, ignore_eos=True)
        tokens = engine.generate([IDS], params)[0].outputs[0].token_ids
    report = {
        "max_logit_diff": float(np.abs(one - sharded).max()),
        "expert_down_shard": list(shard),
        "tokens": list(tokens),
    }
    out.write_text(json.dumps(report))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
