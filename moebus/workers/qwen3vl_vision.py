"""Qwen3-VL's image path on a device backend: the vision tower, its patch merger and the DeepStack
mergers. One image's flattened patches, or its resized bytes patchified on the device
(cuda/kernels/patchify.py), in (common/qwen3vl_image_processor.py), its image-token
embeddings and one DeepStack feature per listed block out (transformers' ``Qwen3VLMoeVisionModel``).

Per image: the 3-D patch convolution is a linear over the flattened (C, T, p, p) patches; the
learned position table is resampled to the patch grid (weighted_rows); pre-norm blocks (LayerNorm,
fused qkv with bias: one strided-batched product, q, k and v each contiguous; 2-D rotary on q and
k, attention over the image's patches only, GELU-tanh MLP); after each block listed in ``deepstack_visual_indexes`` a
DeepStack merger (4 patches -> one row, LayerNorm over the merged row, fc1, GELU, fc2); at the end
the merger (LayerNorm per patch, then the same). Images are encoded one at a time, so attention
never crosses from one image to another."""
from __future__ import annotations

import contextlib
import math
import os

import numpy as np

from moebus.common.qwen3vl_config import Qwen3VisionConfig
from moebus.cuda.kernels.mrope import vision_axes, vision_rope_tables
from moebus.cuda.memory.step_pool import size_class
from moebus.workers.qwen3vl_grid import grid_tables
from moebus.workers import tower_stream
from moebus.workers.tower_graph import TowerGraph
from moebus.workers.tower_outputs import embeds_and_deepstack, views_of_one
from moebus.workers.qwen3vl_weights import BLOCK

MERGER_ACT = "gelu"  # nn.GELU(): exact
STACKED_QKV = True  # q, k, v as one strided-batched product (False: three; tools/device/vltower7_encode.py's A/B)
# the tower's tensor-core products: "" = the backend's (gemm.PRECISION, split inputs), or "bf16" (one
# product on bf16-rounded inputs: half the GEMMs; its fidelity and time in docs/performance.md, vltower8)
GEMM_PRECISION = os.environ.get("MOEBUS_TOWER_GEMM_PRECISION", "")
# fused passes where the backend has them (1 / 0; tools/device/vltower10_encode.py A/Bs them): the rotary, the
# qkv biases and the split of the keys and values in one pass before the fused attention
# (``rope_image_attention``), and a product's residual add in the next LayerNorm (``residual_layernorm_into``).
# On the H200 (vltower10, docs/performance.md) the residual pass and the split attention output equal their
# unfused twins bit for bit; the fused rotary equals numpy's mrope_ref bit for bit where the separate mrope
# kernel does not (NVVM contracts its multiply-adds into FMAs): the tower's outputs 3.7e-6 (relative) apart
FUSED_ROPE = os.environ.get("MOEBUS_TOWER_FUSED_ROPE", "1") != "0"
FUSED_RESIDUAL = os.environ.get("MOEBUS_TOWER_FUSED_RESIDUAL", "1") != "0"
# with FUSED_ROPE, the attention stores proj's split input itself (0: float32 rows, split by split_rows)
SPLIT_ATTENTION_OUT = os.environ.get("MOEBUS_TOWER_SPLIT_ATTENTION_OUT", "1") != "0"
# the image the default vision.vram_mib makes room for (a 1024 x 1024 px image, the processor's
# max_pixels if smaller): a larger one needs more scratch than the caches handed back
REFERENCE_PIXELS = 1024 * 1024
STREAM_SLOTS = 3  # MOEBUS_VISION_STREAM_LAYERS: a block's weights are read by the next block's first norm too


def reference_patches(cfg: Qwen3VisionConfig, processor=None) -> int:
    """Patches of the largest image the memory estimates cover (REFERENCE_PIXELS)."""
    pixels = min(REFERENCE_PIXELS, int(getattr(processor, "max_pixels", REFERENCE_PIXELS)))
    return max(pixels // cfg.patch_size ** 2, cfg.merge_size ** 2)


def encode_scratch_bytes(cfg: Qwen3VisionConfig, num_patches: int) -> int:
    """An upper bound of the device memory one image of ``num_patches`` patches needs beyond the
    weights on the cuda backend: the step's inputs, the kept hidden state and DeepStack features,
    and one block's temporaries (recycled block to block) or one merger's. A block on the tensor
    cores takes 13 (rows, hidden) results or split inputs, the fused attention's two bf16 planes of
    the keys and values (flash_attention.plane_shapes) and two (rows, intermediate) ones."""
    n, tokens = num_patches, num_patches // cfg.merge_size ** 2
    hidden, inter = size_class(n * cfg.hidden_size * 4), size_class(n * cfg.intermediate_size * 4)
    padded_keys, padded_dim = -(-n // 64) * 64, -(-cfg.head_dim // 16) * 16
    planes = size_class(padded_keys * cfg.num_heads * 2 * max(padded_dim, cfg.head_dim) * 2)
    # the patches (made on the device from the bytes, or uploaded), the bytes, rope_pos, indices, weights
    inputs = size_class(n * cfg.patch_dim * 4) + size_class(n * cfg.patch_dim) + 3 * size_class(n * 4 * 4)
    kept = 2 * hidden + (len(cfg.deepstack_layers) + 1) * size_class(tokens * cfg.out_hidden_size * 4)
    block = 13 * hidden + 2 * planes + 2 * inter
    merger = 3 * size_class(tokens * cfg.merged_hidden * 4) + hidden
    return inputs + kept + max(block, merger)


def warm_up_side(merge: int, tensor_cores=None) -> int:
    """Patches per side of the warm-up image: two merge windows, or (with ``tensor_cores``) enough
    that even the merger's rows (one per window) reach its ``min_rows``, so the warm-up takes the
    tensor-core path of every product and of attention, as a real image does."""
    windows = 2 if tensor_cores is None else max(2, math.isqrt(max(int(tensor_cores.min_rows) - 1, 0)) + 1)
    return windows * merge


class Qwen3VisionModel:
    """The tower and mergers of one Qwen3-VL checkpoint, with their weights on ``backend``."""

    def __init__(self, config: Qwen3VisionConfig, weights: dict, backend, packed=None):
        """``packed``: the weights' one device upload (vision_weight_pack.DeviceWeights), or None."""
        self.cfg, self.ops = config, backend
        self.packed = packed
        self._bytes = packed.nbytes if packed is not None else 0
        d = config.hidden_size
        self.patch_weight = self._weight(weights["patch_embed.proj.weight"].reshape(d, -1))
        self.patch_bias = self._weight(weights["patch_embed.proj.bias"])
        self.pos_table = self._weight(weights["pos_embed.weight"], table=True)
        # tower_stream.LayerStream where the blocks are streamed (three slots), else None
        self.layer_stream, self.blocks = tower_stream.place_layers(
            backend, config.depth, lambda i: self._host_block(weights, i), self._weight, STREAM_SLOTS, config.tower)
        self._bytes += self.layer_stream.device_bytes if self.layer_stream is not None else 0
        self.merger = self._merger(weights, "merger.")
        self.deepstack = {layer: self._merger(weights, f"deepstack_merger_list.{j}.")
                          for j, layer in enumerate(config.deepstack_layers)}
        self.axes = backend.persist(vision_axes(config.head_dim))
        self.graph = TowerGraph(backend)  # on cuda the encode of the last image size is one CUDA graph
        self.max_side = 0
        self._rope_tables(4096 // config.patch_size)  # rows and columns of a 4096 px side; grown if needed

    def _rope_tables(self, side: int) -> None:
        """Rotary tables for every row and column of a grid up to ``side`` patches per side."""
        if side > self.max_side:
            self.graph.close()  # it reads the old ones
            self.cos = self.sin = None  # the old ones go before the new ones come
            cos, sin = vision_rope_tables(self.cfg.head_dim, self.cfg.rope_theta, side)
            self.cos, self.sin, self.max_side = self.ops.persist(cos), self.ops.persist(sin), side

    def _weight(self, array, table: bool = False):
        array = np.ascontiguousarray(array)
        out = self.packed.view(array) if self.packed is not None else None
        if out is None:  # (cuda's table is its weight: a view serves both)
            out = (self.ops.table if table else self.ops.weight)(array)
            self._bytes += int(out.size) * np.dtype(out.dtype).itemsize
        return out

    def _host_block(self, weights: dict, i: int) -> dict:
        prefix, d = BLOCK.format(i=i), self.cfg.hidden_size
        w = {name[len(prefix):]: weights[name] for name in weights if name.startswith(prefix)}
        qkv_bias = w["attn.qkv.bias"]  # the fused weight stays: q, k and v in one product (tiled_linears)
        for j, name in enumerate("qkv"):  # each bias where its result is read next (mrope, the v product),
            w[f"attn.{name}.bias"] = qkv_bias[j * d : (j + 1) * d]  # or all three in rope_image_attention
        return w

    def _merger(self, weights: dict, prefix: str) -> dict:
        return {name[len(prefix):]: self._weight(weights[name]) for name in weights if name.startswith(prefix)}

    @property
    def device_bytes(self) -> int:
        """Bytes of weights this model holds on its device (what the cpu ledger is charged)."""
        return self._bytes

    def encode(self, patches: np.ndarray, grid_h: int, grid_w: int) -> tuple[np.ndarray, np.ndarray]:
        """One image's (grid_h * grid_w, patch_dim) float32 patches -> (image embeddings (N, D_text),
        DeepStack features (L, N, D_text)) float32, N = grid_h * grid_w / merge^2."""
        cfg = self.cfg
        patches = np.asarray(patches, dtype=np.float32)
        if patches.shape != (grid_h * grid_w, cfg.patch_dim):
            raise ValueError(f"patches of shape {patches.shape} for a {grid_h} x {grid_w} grid, expected "
                             f"({grid_h * grid_w}, {cfg.patch_dim})")
        return self._encode({"patches": patches}, grid_h, grid_w)

    def encode_stacked(self, image) -> np.ndarray:
        """One preprocessed image (ImagePatches) -> its (1 + L, N, D) embeds and DeepStack features
        stacked (``encode_image``'s two arrays in one)."""
        embeds, deepstack = self.encode_image(image)
        return embeds.base if views_of_one(embeds, deepstack) else np.concatenate([embeds[None], deepstack])

    def encode_pixels(self, pixels: np.ndarray, values: np.ndarray, grid_h: int, grid_w: int) -> tuple:
        """``encode`` of the patches of an image's (grid_h * p, grid_w * p, C) uint8 pixels (resized),
        each byte's value per channel from ``values`` (C, 256) float32: the bytes go to the device
        and the tower makes the patches there (cuda/kernels/patchify.py)."""
        cfg, p = self.cfg, self.cfg.patch_size
        channels = cfg.patch_dim // (cfg.temporal_patch_size * p * p)
        pixels, values = np.asarray(pixels), np.asarray(values, dtype=np.float32)
        if pixels.dtype != np.uint8 or pixels.shape != (grid_h * p, grid_w * p, channels) or \
                values.shape != (channels, 256):
            raise ValueError(f"pixels {pixels.dtype} {pixels.shape} and values {values.shape} for a {grid_h} x "
                             f"{grid_w} grid, expected uint8 ({grid_h * p}, {grid_w * p}, {channels}) and "
                             f"({channels}, 256)")
        return self._encode({"pixels": pixels, "values": values}, grid_h, grid_w)

    def encode_image(self, image) -> tuple[np.ndarray, np.ndarray]:
        """``encode`` of one preprocessed image (ImagePatches): from its bytes where it has them."""
        if getattr(image, "pixels", None) is not None:
            return self.encode_pixels(image.pixels, image.values, image.grid_h, image.grid_w)
        return self.encode(image.patches, image.grid_h, image.grid_w)

    def _encode(self, image_inputs: dict, grid_h: int, grid_w: int) -> tuple[np.ndarray, np.ndarray]:
        cfg = self.cfg
        m = cfg.merge_size
        if grid_h % m or grid_w % m or not grid_h * grid_w:
            raise ValueError(f"a {grid_h} x {grid_w} grid: its sides must be multiples of {m} (and not 0)")
        self._rope_tables(max(grid_h, grid_w))
        positions, indices, weights = grid_tables(grid_h, grid_w, m, cfg.grid_side)
        inputs = {**image_inputs, "rope_pos": positions, "indices": indices, "weights": weights}
        # (a graph also matches its inputs' names: bytes or patches)
        key = (grid_h, grid_w, GEMM_PRECISION, FUSED_ROPE, FUSED_RESIDUAL, SPLIT_ATTENTION_OUT)
        return self.graph.run(key, inputs, self._forward_products, collect=embeds_and_deepstack)

    def capture_pending(self) -> float | None:
        """Capture the graph of the last image size's first encode (tower_graph.py); its seconds."""
        return self.graph.capture_pending()

    def _forward_products(self, inputs: dict) -> dict:
        """_forward at the tower's GEMM_PRECISION: now, or when its graph is captured later."""
        with self._products():
            return self._forward(inputs)

    @contextlib.contextmanager
    def _products(self):
        """The backend's tensor cores at the tower's GEMM_PRECISION while an encode runs (or is captured)."""
        tc = getattr(self.ops, "tensor_cores", None)
        if not GEMM_PRECISION or tc is None or tc.precision == GEMM_PRECISION:
            yield
            return
        from moebus.cuda.backends.graphs import swapped
        from moebus.cuda.kernels.gemm import TensorCores

        with swapped(self.ops, tensor_cores=TensorCores(tc.blas, GEMM_PRECISION, tc.min_rows)):
            yield

    def _forward(self, inputs: dict) -> dict:
        """The tower and mergers over one image's device inputs (its ``patches``, or its ``pixels``
        and their ``values``): kernels only (tower_graph.py); ``embeds`` and ``deepstack0`` ... out."""
        ops, cfg = self.ops, self.cfg
        patches = inputs.get("patches")
        if patches is None:
            patches = ops.pixel_patches(inputs["pixels"], inputs["values"], cfg.patch_size, cfg.merge_size,
                                        cfg.temporal_patch_size)
        stream = self.layer_stream
        if stream is not None:  # the first blocks come up while the patches are embedded
            stream.begin()
        positions = ops.weighted_rows(self.pos_table, inputs["indices"], inputs["weights"])
        x = ops.bias_residual(positions, ops.tiled_linear(patches, self.patch_weight), self.patch_bias)
        features = []
        mark = ops.layer_mark()  # the inputs above live all step; each block's temporaries serve the next
        pending = None  # the last block's (fc2 product, its bias), added to x by the next block's first norm
        for i, block in enumerate(self.blocks):
            if stream is not None:
                stream.before(i)
            x, pending = self._encoder_block(block, x, inputs["rope_pos"], pending)
            if stream is not None:  # block i's first norm added block i - 1's fc2 bias: its slot is free
                stream.after(i - 1)
            if i in self.deepstack or i == len(self.blocks) - 1 or not self._fuses_residual():
                x, pending = ops.bias_residual(x, *pending), None
            if i in self.deepstack:
                features.append(self._merge(self.deepstack[i], x, post_shuffle_norm=True))
                self.graph.emit(f"deepstack{len(features) - 1}", features[-1])  # its copy out starts now
            ops.recycle_layer(mark, (x, *features) + (pending[:1] if pending else ()))
        out = {"embeds": self._merge(self.merger, x, post_shuffle_norm=False)}
        out.update({f"deepstack{j}": feature for j, feature in enumerate(features)})
        return out

    def _fuses_residual(self) -> bool:
        return FUSED_RESIDUAL and hasattr(self.ops, "residual_layernorm_into")

    def _norm_into(self, x, residual, weight, bias, next_weight):
        """(x + residual's product and bias if ``residual``, the LayerNorm of that as the input of
        ``next_weight``'s products): one pass where the backend fuses them."""
        eps = self.cfg.layer_norm_eps
        if residual is None:
            return x, self.ops.layernorm_into(x, weight, bias, eps, next_weight)
        if self._fuses_residual():
            return self.ops.residual_layernorm_into(x, *residual, weight, bias, eps, next_weight)
        x = self.ops.bias_residual(x, *residual)
        return x, self.ops.layernorm_into(x, weight, bias, eps, next_weight)

    def _encoder_block(self, w: dict, x, rope_pos, residual=None) -> tuple:
        """One block over x (plus ``residual``: the last block's fc2 (product, bias), not yet added)
        -> (x after attention, (its fc2 product, bias)): the caller adds them, or the next block."""
        ops, cfg = self.ops, self.cfg
        rows, heads, hd = x.shape[0], cfg.num_heads, cfg.head_dim
        x, h = self._norm_into(x, residual, w["norm1.weight"], w["norm1.bias"], w["attn.qkv.weight"])  # split once
        fused = FUSED_ROPE and hasattr(ops, "rope_image_attention") and ops.rope_attention_ready(
            rows, hd, w["attn.qkv.bias"])
        q, k, v = (y.reshape(rows, heads, hd) for y in self._qkv(h, w, with_v_bias=not fused))
        if fused:  # the rotary, the biases and the keys' and values' split in one pass, then attention
            a = ops.rope_image_attention(q, k, v, w["attn.qkv.bias"], rope_pos, self.axes, self.cos, self.sin,
                                         hd ** -0.5, w["attn.proj.weight"] if SPLIT_ATTENTION_OUT else None)
        else:
            q, k = (ops.mrope(y, rope_pos, self.axes, self.cos, self.sin, bias=w[f"attn.{n}.bias"])
                    for y, n in ((q, "q"), (k, "k")))
            a = ops.vision_attention(q, k, v, 1, hd ** -0.5)
        if len(a.shape) == 3:
            a = a.reshape(rows, heads * hd)
        proj = (ops.tiled_linear(a, w["attn.proj.weight"]), w["attn.proj.bias"])
        x, h = self._norm_into(x, proj, w["norm2.weight"], w["norm2.bias"], w["mlp.linear_fc1.weight"])
        h = ops.bias_activation_into(ops.tiled_linear(h, w["mlp.linear_fc1.weight"]), w["mlp.linear_fc1.bias"],
                                     cfg.hidden_act, w["mlp.linear_fc2.weight"])
        return x, (ops.tiled_linear(h, w["mlp.linear_fc2.weight"]), w["mlp.linear_fc2.bias"])

    def _qkv(self, h, w: dict, with_v_bias: bool = True) -> tuple:
        """q and k without their biases (mrope adds them), v with its own (or without: the fused
        rotary adds all three): one product of the fused weight per part where h is split
        (STACKED_QKV), else three."""
        biases = (None, None, w["attn.v.bias"] if with_v_bias else None)
        if STACKED_QKV:
            return self.ops.tiled_linears(h, w["attn.qkv.weight"], biases)
        d = self.cfg.hidden_size
        return tuple(self.ops.tiled_linear(h, w["attn.qkv.weight"][j * d:(j + 1) * d], bias)
                     for j, bias in enumerate(biases))

    def _merge(self, w: dict, x, post_shuffle_norm: bool):
        """merge^2 consecutive patches (one merge window) -> one row of the text's width."""
        ops, cfg = self.ops, self.cfg
        merged = cfg.merged_hidden
        if post_shuffle_norm:  # DeepStack: LayerNorm over the merged row
            h = ops.layernorm_into(x.reshape(x.shape[0] // cfg.merge_size ** 2, merged), w["norm.weight"],
                                   w["norm.bias"], cfg.layer_norm_eps, w["linear_fc1.weight"])
        else:  # the final merger: LayerNorm per patch, then merged
            h = ops.layernorm(x, w["norm.weight"], w["norm.bias"], cfg.layer_norm_eps)
            h = h.reshape(x.shape[0] // cfg.merge_size ** 2, merged)
        h = ops.bias_activation_into(ops.tiled_linear(h, w["linear_fc1.weight"]), w["linear_fc1.bias"], MERGER_ACT,
                                     w["linear_fc2.weight"])
        return ops.tiled_linear(h, w["linear_fc2.weight"], w["linear_fc2.bias"])

    def encode_reply(self, images: list) -> dict:
        """ENCODE_REPLY's arrays for preprocessed images (ImagePatches): ``embeds`` (1 + L, N, D), the
        embeddings and the DeepStack features stacked (as the broker keeps them: no copy there)."""
        stacked = [self.encode_stacked(image) for image in images]
        return {"embeds": stacked[0] if len(stacked) == 1 else np.concatenate(stacked, axis=1)}

    def warm_up(self, processor) -> None:
        """Encode a blank image's bytes (warm_up_side): every kernel compiles or loads now, and cuBLAS
        starts, so that a request's first encode (eager, tower_graph.py) pays for neither. Its
        graph is never captured (the next image size replaces it)."""
        cfg = self.cfg
        side = warm_up_side(cfg.merge_size, getattr(self.ops, "tensor_cores", None))
        channels = cfg.patch_dim // (cfg.temporal_patch_size * cfg.patch_size ** 2)
        pixels = np.zeros((side * cfg.patch_size, side * cfg.patch_size, channels), np.uint8)
        self.encode_pixels(pixels, np.zeros((channels, 256), np.float32), side, side)

    def encode_images(self, images: list) -> tuple[np.ndarray, np.ndarray]:
        """Several images (ImagePatches) -> (embeddings (sum N_i, D), DeepStack (L, sum N_i, D))."""
        outs = [self.encode_image(image) for image in images]
        if len(outs) == 1:
            return outs[0]  # one image (the usual request): its arrays are fresh copies already
        return np.concatenate([e for e, _ in outs]), np.concatenate([f for _, f in outs], axis=1)
