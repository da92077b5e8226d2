"""What the decode sweeps share (decode10_sweep.py and quant9_sweep.py import it; the seventh
session's own sweep and decode7_*.sh were removed in the eleventh: see README.md): bench decode's
prompt and timing (greedy after a 32-token prompt, median step of the second of 2 repeats of 64
tokens), a kernel constant by its "module.CONSTANT" key, and dropping a model's decode graphs so that
the next steps capture them again with the constants set."""
import importlib

PROMPT = [(7 * i + 3) % 200 + 10 for i in range(32)]
TOKENS, REPEATS = 64, 2


def constant(key: str):
    """(module of moebus.cuda.kernels, name) of ``key`` "module.CONSTANT", for getattr / setattr."""
    module, name = key.rsplit(".", 1)
    return importlib.import_module(f"moebus.cuda.kernels.{module}"), name


def drop_graphs(model) -> None:
    for stage in model.stages:
        for graph in stage.graphs.values():
            graph.close()
        stage.graphs.clear()
