"""Cost-faithful stand-in targets: a big model that computes exactly a small model's function.

A stand-in zero-pads a llama-architecture, LFM2 (``lfm2``, short-conv/attention hybrid) or Gemma 3
(``gemma3``; see the ``gemma3`` module, which also covers quantized sources) GGUF
to a wider hidden size, a wider FFN and more attention heads, and adds layers that write nothing
to the residual stream. Its logits equal the source's, while every decode step moves the bytes
and does the FLOPs of the big shape. So acceptance comes from the real (small) trained model and
cost comes from the big one.

Why it is exact (d = source width, W = stand-in width; original coordinates come first):

- The residual stream holds m copies of the source's d coordinates, then zeros: the embedding
  columns are repeated m times and every weight that writes to the residual (attention output,
  FFN down, LFM2's short-conv out_proj) has its rows repeated m times and zero rows after that.
  Zero coordinates stay zero.
- RMSNorm over W coordinates: mean_W(x^2) = (m d / W) mean_d(x^2). With epsilon scaled by
  c^2 = m d / W and the norm weight by c on the first copy (zero elsewhere), the normalised
  coordinates the next matrices read are unchanged, and the other copies read as zeros.
  m is the smallest count with W / (m d) a power of 4 (m = 1 when W/d is 1, 4, 16, ..; m = 2
  for 2, 8, 32, ..; m = 3 for 3, 12, ..): then c is a power of two and every rescaling
  is exact in floating point, so the stand-in's logits equal the source's bit for bit. With
  m = 1 and W/d = 2 the norms would be off by an F32 ulp, which Q8_0 activation rounding
  amplifies to logit differences of ~0.04 and real greedy flips. Widths that are not a whole
  multiple of d fall back to m = 1, c = sqrt(d / W): close, not bit-exact.
- Extra query heads have zero Wq rows, so they attend uniformly over values they never pass on
  (their Wo columns are zero). KV heads grow in the same ratio and original heads come first, so
  llama.cpp's grouped-query mapping (query head h reads KV head h // (n_head / n_head_kv)) still
  sends original query heads to original KV heads. ``kv_heads`` may instead ask for fewer KV
  heads (a bigger group, R query heads per KV head instead of the source's r, to match a real
  model's KV-cache size): source query head h then sits at slot (h // r) R + h % r, so it still
  reads its own KV head. The R - r extra query heads of a source group read real values, which
  their zero Wo columns drop; exact in F16, and in Q8_0 when head_dim is a multiple of 32, but not
  in Q4_K_M (its 256-wide blocks then mix heads differently).
- Extra FFN units have zero gate/up rows and zero down columns.
- Extra layers copy a source layer's weights (realistic magnitudes, so no overflow) but have zero
  attention-output and FFN-down matrices, so they add exactly zero.

LFM2 (``lfm2``; llama.cpp ``src/models/lfm2.cpp``). The output norm is ``token_embd_norm``; each
layer is ``x += op(attn_norm(x)); x += ffn(ffn_norm(x))`` where op is GQA attention on layers
whose ``lfm2.attention.head_count_kv`` entry is > 0 and a gated short convolution on the others.

- One epsilon (``lfm2.attention.layer_norm_rms_epsilon``) serves the residual norms *and* the
  per-head q/k norms. The q/k norms act on head_dim values that padding does not change, so
  their epsilon must not be rescaled: LFM2 stand-ins therefore keep c = 1 by using m = W / d
  residual copies (W a multiple of d; W/d = 8 gives 8 copies). Then epsilon is the source's,
  and the logits are bit-identical. W not a multiple of d falls back to m = 1 and a rescaled
  epsilon, which the q/k norms also see: close, not bit-exact.
- attention layers: q/k/v/output as above; ``attn_q_norm``/``attn_k_norm`` (length head_dim,
  shared by all heads) are copied unchanged: a source head's q and k are the source's, and an
  extra head's zero q/k normalise to zero (rms_norm(0) = 0 * 1/sqrt(eps)).
- short-conv layers: ``shortconv.in_proj`` (d -> 3d: chunks B, C, x) becomes W -> 3W with each
  chunk padded separately (the source's d rows at the top of each W-row chunk, reading only the
  first residual copy, like q/k/v); so B, C and x of the extra channels are 0, their B*x is 0,
  the depthwise causal conv (``shortconv.conv``, {l_cache, W}; extra channels' taps are zero)
  gives 0 there and the source's exact values in the source channels (each channel's taps only
  see that channel), and C*conv is 0 in the extra channels. ``shortconv.out_proj`` writes the
  residual: rows repeated m times, the source's d columns first. The conv state grows to
  (l_cache - 1) x W per sequence, as it would in a real W-wide model.
- layer mix: extra layers are short-conv or attention so that the stand-in keeps the source's
  conv:attention ratio (``attn_layers`` overrides it, e.g. 6 of 16 as in LFM2-1.2B), spread
  evenly; ``lfm2.attention.head_count_kv`` is rewritten per layer (0 on conv layers). A filler
  layer copies a source layer of its own type with its output matrix and ffn_down zeroed.

Quantized stand-ins are made with llama.cpp's own quantizer. The source width fills whole quant
blocks, so the original blocks quantize identically. Q4_K_M also picks some tensor types by layer
index (``use_more_bits`` in llama-quant.cpp), so the source layers are placed at layer slots that
get the same types as in the source; the zero layers fill the other slots. For LFM2 two counters
matter (llama-quant.cpp walks tensors in layer order): ``ffn_down`` of layer i is Q6_K iff
use_more_bits(i, n_layer), and ``attn_v`` of the k-th *attention* layer is Q6_K iff
use_more_bits(k, n_attention_layers). The layout search picks the layer types and the live slots
so that both verdicts, and the layer type, match the source's for every source layer (it refuses
q4_k_m when no such layout exists near the requested mix). ``shortconv.conv`` is never quantized;
``shortconv.in_proj``/``out_proj`` get the default Q4_K.

Modules, one job each (this package re-exports the API other code imports):

- ``shape``: ``LlamaShape`` (a source's or stand-in's shape), ``StandinPlan`` (how the source maps
  into the stand-in, and whether it is exact per ftype), ftypes, tensor kinds, ``StandinError``.
- ``source``: reading the source GGUF: its shape, its fields, its tensors as floats.
- ``llama``: layer placement for llama (dense and MoE) sources: llama.cpp's ``use_more_bits`` rule
  and the residual copy count m.
- ``gemma3``: Gemma 3 sources: checks, layout (source layers first) and padding, from floats or
  by copying a quantized source's blocks.
- ``lfm2``: layer layout for LFM2 sources: how many attention layers, where, and where each source
  layer goes so Q4_K_M keeps its tensor types.
- ``plan``: ``plan_standin``: checks a request and builds the ``StandinPlan`` (pure, no I/O).
- ``pad``: padding one tensor of a layer (dense, MoE experts, LFM2 short-conv), pure numpy.
- ``metadata``: the stand-in's GGUF key/values (the source's, with the new shape and epsilon).
- ``vocab``: ``--vocab N``: which of a SentencePiece source's tokens a smaller vocabulary keeps (not exact).
- ``writer``: which tensors, in which order, and writing the F16 stand-in one tensor at a time.
- ``make``: ``make_standin`` (F16, then llama.cpp's quantizer for q8_0/q4_k_m) and ``quantize_gguf``.
- ``output``: checks before writing: the output's folder, and whether the files fit its free space.
- ``quantize``: llama.cpp's quantizer in a child process, with a progress bar, stopped at once by a signal.

Random-weight MTP stand-ins are a different kind (``make-standin --mtp``): no source function is kept, only a
real MTP model's layout and cost, so they serve cost and losslessness, never acceptance.

- ``mtp_layouts``: the real models' shapes (qwen35moe, qwen35, glm4moe) and ``mtp_shape`` (reduced depth, width).
- ``mtp_tensors``: every tensor and key/value llama.cpp's loader reads for such a shape (pure).
- ``mtp``: ``make_mtp_standin``: random F16 weights one tensor at a time, then the same quantizer.
"""

from .lfm2 import lfm2_layer_layout
from .llama import use_more_bits, live_layer_slots
from .make import make_standin, quantize_gguf
from .plan import plan_standin
from .shape import FTYPES, LlamaShape, StandinPlan
from .source import read_shape, read_source_shape

__all__ = [
    "FTYPES",
    "LlamaShape",
    "StandinPlan",
    "use_more_bits",
    "lfm2_layer_layout",
    "live_layer_slots",
    "make_standin",
    "plan_standin",
    "quantize_gguf",
    "read_shape",
    "read_source_shape",
]
