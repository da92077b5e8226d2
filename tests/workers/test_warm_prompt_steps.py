"""graph_warmup.warm_prompt_sizes / warm_prompt_steps (gpu_worker.warm_prompt_path): the prompt steps a GPU worker
runs at start, so that a text stream's first 5-9-token step finds its GEMV variants compiled."""
import numpy as np

from moebus.workers.batch import StepBatch
from moebus.workers.graph_warmup import warm_prompt_sizes, warm_prompt_steps
from moebus.workers.local import LocalModel
from tests.cuda.test_launch_ahead import micro_model  # noqa: F401 - the fixture


def test_sizes_are_the_gemv_token_counts_no_graph_ran_and_one_past():
    assert warm_prompt_sizes(4, 8) == [5, 6, 7, 8, 9]
    assert warm_prompt_sizes(1, 8) == [2, 3, 4, 5, 6, 7, 8, 9]
    assert warm_prompt_sizes(64, 8) == [9]


def test_prompt_steps_run_and_leave_the_stage_serving_as_before(micro_model):  # noqa: F811
    prompt = [5, 17, 42, 9, 77]

    def first_token(warm: bool) -> int:
        model = LocalModel(micro_model, device="cpu", num_slots=2, max_context=16)
        stage = model.stages[0]
        if warm:
            assert warm_prompt_steps(stage, [3, 9, 40]) == 2  # 40: past the context, not run
        out = model.step(StepBatch(slots=[0], starts=[0], lengths=[len(prompt)], tokens=prompt, temperature=[0.0]))
        return int(np.asarray(out.tokens)[0])
    assert first_token(True) == first_token(False)
