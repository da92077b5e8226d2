"""LLaVA's image path on a device backend: the SigLIP or CLIP vision tower up to the selected hidden
state(s), then the multimodal projector. Images in, one text-sized embedding per image token out.

SigLIP: patch conv (stride = patch, with bias) + learned positions, pre-norm encoder layers
(LayerNorm, MHA with biases, MLP with gelu_pytorch_tanh). CLIP: a class position first, patch conv
without bias, ``pre_layrnorm`` before the encoder, quick_gelu. LLaVA reads ``hidden_states[k]``,
before ``post_layernorm``, so neither the final norm nor the pooling head ever runs."""
from __future__ import annotations

import functools

import numpy as np

from moebus.common.errors import ConfigError
from moebus.common.vision_config import VisionConfig
from moebus.cuda.dtypes import to_f32
from moebus.cuda.memory.step_pool import size_class
from moebus.workers import tower_slices, tower_stream
from moebus.workers.tower_graph import TowerGraph
from moebus.workers.vision_weight_pack import DeviceWeights, HostWeights
from moebus.workers.vision_weights import LAYER, PROJECTOR, load_vision_weights  # noqa: F401 (re-exported)


def patches(pixel_values: np.ndarray, patch_size: int, class_row: bool) -> np.ndarray:
    """(N, C, H, W) -> (N * positions, C p p) rows in the conv weight's (C, kh, kw) order, patches
    row-major as the conv output is flattened; a zero row first per image for CLIP's class position
    (the patch linear maps it to exactly 0, and the class embedding is folded into the positions)."""
    n, c, h, w = pixel_values.shape
    p = patch_size
    # a stride-p conv without padding leaves out the last h % p rows and w % p columns (SigLIP-so400m:
    # 384 px in patches of 14 is 27 patches over 378 px)
    pixel_values = pixel_values[:, :, : h // p * p, : w // p * p]
    grid = pixel_values.reshape(n, c, h // p, p, w // p, p).transpose(0, 2, 4, 1, 3, 5)
    rows = grid.reshape(n, (h // p) * (w // p), c * p * p)
    if class_row:
        rows = np.concatenate([np.zeros((n, 1, c * p * p), np.float32), rows], axis=1)
    return np.ascontiguousarray(rows.reshape(-1, c * p * p), dtype=np.float32)


def encode_scratch_bytes(cfg: VisionConfig, num_images: int, processor=None) -> int:
    """Qwen3-VL's towers (``cfg.tower == "qwen3_vl"``): workers/qwen3vl_vision.py's bound for the
    largest image ``processor`` makes, up to REFERENCE_PIXELS. LLaVA's: an upper bound of the device memory an encode of ``num_images`` needs beyond the weights on
    the cuda backend: the kept hidden states, plus the step pool, which holds per size class the
    most buffers any step took (bounded here by the sum of the three kinds of step: embedding, one
    encoder layer with ten (rows, hidden) and two (rows, intermediate) results, projector)."""
    if cfg.tower == "qwen3_vl":
        from moebus.workers import qwen3vl_vision

        return qwen3vl_vision.encode_scratch_bytes(cfg, qwen3vl_vision.reference_patches(cfg, processor))
    rows = num_images * cfg.num_positions
    hidden, inter, text = (size_class(rows * n * 4) for n in (cfg.hidden_size, cfg.intermediate_size,
                                                                cfg.text_hidden_size))
    num_features = len(cfg.feature_layers)
    kept = (1 + len(set(cfg.feature_layers))) * rows * cfg.hidden_size * 4 + rows * 4
    embed = size_class(rows * cfg.num_channels * cfg.patch_size ** 2 * 4) + 3 * hidden
    layer = 10 * hidden + 2 * inter
    projector = size_class(rows * 4) + num_features * (hidden + 2 * text) + 2 * text
    return kept + embed + layer + projector


# A first encode on cuda holds more than its arrays: cuBLAS's start (its handle, the 32 MiB workspace gemm_host.py
# gives it, its first modules) and the kernels' modules loaded for it. On the H100 (thirty-second session) a lazy
# start's first encode took 244.0 MiB more than the start, twice to the 0.1 MiB, of which encode_scratch_bytes
# reckoned 128.4 for so400m: 115.6 the rest; the H200 (thirty-third) measured the same 244.0, of it cuBLAS's start
# 98.0 (70.0 at MOEBUS_CUBLAS_WORKSPACE_MB=4), the preload's kernels 0.0. Until a first encode was measured on a
# GPU the reckonings count it (before, the first image's hand-back was ~50 MiB short of what the worker then held,
# over a gpu_memory_mib budget unnoticed).
FIRST_ENCODE_LOADS_BYTES = 116 * (1 << 20)


def first_encode_bytes(cfg: VisionConfig, num_images: int, processor=None) -> int:
    """What a vision worker's first encode of ``num_images`` adds on a cuda device, reckoned: its
    arrays (encode_scratch_bytes, an upper bound) and the loads beside them (FIRST_ENCODE_LOADS_BYTES)."""
    return encode_scratch_bytes(cfg, num_images, processor) + FIRST_ENCODE_LOADS_BYTES


def make_vision_model(cfg, weights: dict, backend, beside: bool = False):
    """The vision model of a config: LLaVA's VisionModel or Qwen3-VL's Qwen3VisionModel, which
    share ``encode_reply``, ``warm_up``, ``capture_pending`` and ``device_bytes`` (what the vision
    worker uses). ``weights`` packed in one host buffer (vision_weight_pack.pack, the zygote's) go
    to a cuda device in one copy; the tensors a model derives from them (not views of the buffer)
    are uploaded one by one as before. ``beside``: that copy runs while the caller goes on, until
    ``model.packed.wait()`` (the vision worker's warm-up needs no true values)."""
    packed = None
    streamed = backend.name == "cuda" and tower_stream.stream_layers_from_env(tower=cfg.tower)
    if isinstance(weights, HostWeights) and backend.name == "cuda" and not streamed:
        packed = DeviceWeights(backend, weights, beside)  # (streamed: the layers stay on the host, the rest is small)
    if cfg.tower == "qwen3_vl":
        from moebus.workers.qwen3vl_vision import Qwen3VisionModel

        return Qwen3VisionModel(cfg, weights, backend, packed)
    return VisionModel(cfg, weights, backend, packed)


def device_weight(ops, packed, array):
    """(the device array of a weight, the bytes of a new allocation it took): a view of the packed
    upload where the array lies in it, else its own upload through the backend."""
    out = packed.view(array) if packed is not None else None
    if out is not None:
        return out, 0
    out = ops.weight(array)
    return out, int(out.size) * np.dtype(out.dtype).itemsize


class VisionModel:
    """The tower and projector of one LLaVA checkpoint, with their weights on ``backend``."""

    def __init__(self, config: VisionConfig, weights: dict, backend, packed: DeviceWeights | None = None):
        """On cuda the encoder layers are streamed unless MOEBUS_VISION_STREAM_LAYERS=0 (tower_stream.py)."""
        self.cfg, self.ops = config, backend
        self.packed = packed
        self._bytes = packed.nbytes if packed is not None else 0
        self._kept = None  # device buffers that outlive a step (see _kept_buffers)
        self.graph = TowerGraph(backend)  # on cuda the encode is one CUDA graph
        d = config.hidden_size
        self.patch_weight = self._weight(weights["embeddings.patch_embedding.weight"].reshape(d, -1))
        self.patch_bias = self._weight(weights.get("embeddings.patch_embedding.bias"))
        positions = to_f32(weights["embeddings.position_embedding.weight"]).copy()
        if config.tower == "clip":
            positions[0] += to_f32(weights["embeddings.class_embedding"])  # cat(class, patches) + positions
        self.positions = self._weight(positions)
        self.pre_norm = [self._weight(weights.get("pre_layrnorm." + k)) for k in ("weight", "bias")]
        if backend.name == "cuda" and tower_stream.stream_layers_from_env(tower=config.tower) and \
                tower_slices.SLICE_LAYERS > 0:
            # a slice's graph cannot wait on a copy another slice's recorded
            raise ConfigError("MOEBUS_VISION_STREAM_LAYERS=1 does not go with MOEBUS_TOWER_SLICE_LAYERS > 0 "
                              "(the tower in slices): set one of them")
        # tower_stream.LayerStream where the encoder layers are streamed, else None
        self.layer_stream, self.layers = tower_stream.place_layers(
            backend, config.num_layers_run, lambda i: self._host_layer(weights, i), self._weight, tower=config.tower)
        self._bytes += self.layer_stream.device_bytes if self.layer_stream is not None else 0
        w1 = weights[PROJECTOR + "linear_1.weight"]
        # linear_1 over concatenated feature layers = the sum of one column block per layer, so the
        # hidden states never need a device concat
        self.proj_in = [self._weight(np.ascontiguousarray(w1[:, j * d : (j + 1) * d]))
                        for j in range(len(config.feature_layers))]
        self.proj_out = self._weight(weights[PROJECTOR + "linear_2.weight"])
        self.proj_bias = [self._weight(weights.get(PROJECTOR + f"linear_{j}.bias")) for j in (1, 2)]

    def _weight(self, array):
        if array is None:
            return None
        out, nbytes = device_weight(self.ops, self.packed, np.ascontiguousarray(array))
        self._bytes += nbytes
        return out

    @staticmethod
    def _host_layer(weights: dict, i: int) -> dict:
        prefix = LAYER.format(i=i)
        return {name[len(prefix):]: np.ascontiguousarray(array) for name, array in weights.items()
                if name.startswith(prefix)}

    @property
    def device_bytes(self) -> int:
        """Bytes of weights this model holds on its device (what the cpu ledger is charged)."""
        return self._bytes

    def capture_pending(self) -> float | None:
        """Capture the graph of the last image count's first encode (tower_graph.py); its seconds."""
        return self.graph.capture_pending()

    def encode(self, pixel_values: np.ndarray) -> np.ndarray:
        """(N, C, H, W) float32 pixel values -> (N, num_image_tokens, text_hidden_size) float32."""
        cfg = self.cfg
        pixel_values = np.asarray(pixel_values, dtype=np.float32)
        expected = (cfg.num_channels, cfg.image_size, cfg.image_size)
        if pixel_values.ndim != 4 or pixel_values.shape[1:] != expected or pixel_values.shape[0] == 0:
            raise ValueError(f"pixel values of shape {pixel_values.shape}, expected (N >= 1, "
                             f"{', '.join(map(str, expected))})")
        num_images = pixel_values.shape[0]
        kept = self._kept_buffers(num_images)
        rows = patches(pixel_values, cfg.patch_size, cfg.tower == "clip")
        out = self.graph.run(num_images, {"patches": rows}, self._slices(kept, tower_slices.SLICE_LAYERS))
        return out["embeds"].reshape(num_images, cfg.num_image_tokens, cfg.text_hidden_size)

    def _slices(self, kept: dict, per_slice: int = 0):
        """The forward for tower_graph: the tower and projector over the device patches, kernels only.
        ``per_slice`` > 0 (tower_slices.SLICE_LAYERS): a list of slices of that many encoder layers each,
        the embedding in the first, the projector in the last; tower_graph runs them in turn (a graph
        each on cuda) with a pause between. The same launches in the same order either way, so the
        same bits: between slices the hidden state lies in kept memory, as between layers."""
        n = len(self.layers)
        bounds = list(range(0, n, per_slice)) + [n] if 0 < per_slice < n else [0, n]
        state = {}
        stream = self.layer_stream

        def run(first: int, last: int, inputs: dict):
            if first == 0:
                if stream is not None:  # layers 0 and 1 come up while the embedding runs
                    stream.begin()
                state["mark"] = self._embed(inputs, kept)
            for i in range(first, last):
                # one layer's scratch at a time: the hidden state is carried in kept memory
                self.ops.recycle_layer(state["mark"], ())
                if stream is not None:
                    stream.before(i)
                self._keep(self._encoder_layer(self.layers[i], kept["x"], kept["num_images"]), kept, i + 1)
                if stream is not None:  # its slot takes layer i + 2 once this layer's kernels have read it
                    stream.after(i)
            if last == n:
                self.ops.recycle_layer(state["mark"], ())
                features = [self._select(kept[k], kept["select"]) for k in self.cfg.feature_layers]
                return {"embeds": self._project(features)}
            return {}

        slices = [functools.partial(run, a, b) for a, b in zip(bounds, bounds[1:])]
        return slices if len(slices) > 1 else slices[0]

    def _embed(self, inputs: dict, kept: dict) -> int:
        """The patch embedding into kept["x"]; the pool's mark that each layer's scratch goes back to."""
        cfg, ops = self.cfg, self.ops
        mark = ops.layer_mark()
        x = ops.add_bias(ops.tiled_linear(inputs["patches"], self.patch_weight, self.patch_bias), self.positions)
        if cfg.tower == "clip":
            x = ops.layernorm(x, *self.pre_norm, cfg.layer_norm_eps)
        self._keep(x, kept, 0)
        return mark

    def encode_reply(self, pixels: list[np.ndarray]) -> dict:
        """ENCODE_REPLY's arrays for preprocessed images: ``embeds`` (N * num_image_tokens, D), one
        image per tower pass (an image is already hundreds of rows per matmul, so batching images
        would add scratch, charged per image, and little speed)."""
        out = np.concatenate([self.encode(p[None]) for p in pixels])
        return {"embeds": np.ascontiguousarray(out.reshape(-1, out.shape[-1]), dtype=np.float32)}

    def warm_up(self, processor) -> None:
        """Run the tower once on a blank image: kernels are compiled (first start) or loaded from
        numba's on-disk cache here, before VISION_READY, never inside a request."""
        cfg = self.cfg
        height, width = processor.image_size or (cfg.image_size, cfg.image_size)
        self.encode(np.zeros((1, cfg.num_channels, height, width), np.float32))

    def _kept_buffers(self, num_images: int) -> dict:
        """Device buffers that outlive a step: the hidden state ("x"), one per selected hidden state,
        the row numbers that copy into them and the rows _select keeps; kept for the last image
        count seen."""
        if self._kept is None or self._kept["num_images"] != num_images:
            self._kept = None  # the old ones go before the new ones come
            rows = num_images * self.cfg.num_positions
            shape = (rows, self.cfg.hidden_size)
            self.graph.close()  # it reads the old ones
            positions = self.cfg.num_positions  # the selected rows (_select) of each image
            select = (np.arange(num_images)[:, None] * positions + np.arange(1, positions)[None]).ravel()
            self._kept = {"num_images": num_images, "x": self.ops.zeros(shape),
                          "rows": self.ops.persist(np.arange(rows, dtype=np.int32)),
                          "select": self.ops.persist(select.astype(np.int32))}
            self._kept.update({k: self.ops.zeros(shape) for k in set(self.cfg.feature_layers)})
        return self._kept

    def _keep(self, x, kept: dict, index: int):
        """The hidden state after ``index`` layers, copied out of this step's scratch (the copy is
        ordered after every read of the previous state on the stream)."""
        if index in kept:
            self.ops.scatter_rows(kept[index], kept["rows"], x)
        return self.ops.scatter_rows(kept["x"], kept["rows"], x)

    def _encoder_layer(self, w: dict, x, num_images: int):
        ops, cfg = self.ops, self.cfg
        rows, heads, hd = x.shape[0], cfg.num_heads, cfg.head_dim
        h = ops.layernorm_into(x, w["layer_norm1.weight"], w["layer_norm1.bias"], cfg.layer_norm_eps,
                               w["self_attn.q_proj.weight"])  # split once for q, k, v on the tensor cores
        q, k, v = (ops.tiled_linear(h, w[f"self_attn.{n}_proj.weight"], w[f"self_attn.{n}_proj.bias"])
                   .reshape(rows, heads, hd) for n in "qkv")
        a = ops.vision_attention(q, k, v, num_images, hd ** -0.5).reshape(rows, heads * hd)
        x = ops.add(x, ops.tiled_linear(a, w["self_attn.out_proj.weight"], w["self_attn.out_proj.bias"]))
        h = ops.layernorm_into(x, w["layer_norm2.weight"], w["layer_norm2.bias"], cfg.layer_norm_eps,
                               w["mlp.fc1.weight"])
        h = ops.activation(ops.tiled_linear(h, w["mlp.fc1.weight"], w["mlp.fc1.bias"]), cfg.hidden_act)
        return ops.add(x, ops.tiled_linear(h, w["mlp.fc2.weight"], w["mlp.fc2.bias"]))

    def _select(self, hidden, select):
        """The 'default' strategy drops position 0 of every image (CLIP's class position; for SigLIP,
        which has none, its first patch, exactly as transformers does): the rows ``select``."""
        if self.cfg.select_strategy != "default":
            return hidden
        return self.ops.embedding(hidden, select)

    def _project(self, features: list):
        ops = self.ops
        y = ops.tiled_linear(features[0], self.proj_in[0], self.proj_bias[0])
        for feature, weight in zip(features[1:], self.proj_in[1:]):
            y = ops.add(y, ops.tiled_linear(feature, weight))
        return ops.tiled_linear(ops.activation(y, self.cfg.projector_act), self.proj_out, self.proj_bias[1])
