"""Where each expected verdict comes from: torch's source at 2.13.0 (Python files with their
line, C++ files of the PyTorch repository by function) and the CUDA-graph docs. The cases
compose these into their ``source``."""

TORCH_DOCS = "https://docs.pytorch.org/docs/stable/notes/cuda.html#constraints"
NV_CHECKLIST = "https://docs.nvidia.com/dl-cuda-graph/torch-cuda-graph/quick-checklist.html"
NV_CONSTRAINTS = "https://docs.nvidia.com/dl-cuda-graph/cuda-graph-basics/constraints.html"
NV_NUMERICAL = "https://docs.nvidia.com/dl-cuda-graph/troubleshooting/numerical-errors.html"
CUDA_GUIDE = ("https://docs.nvidia.com/cuda/cuda-c-programming-guide/index.html"
              "#prohibited-and-unhandled-operations")

#: A host read: what every sync-on-the-host reason ends with.
_SYNC = ("a device-to-host read (_local_scalar_dense_cuda: memcpy_and_sync, a "
         "cudaStreamSynchronize) that a capturing stream refuses, 'operation not permitted when "
         f"stream is capturing' ({NV_CONSTRAINTS})")


def linalg(fn: str) -> str:
    """A linalg op whose error check reads its info tensor on the host."""
    return (f"aten/src/ATen/native/BatchLinearAlgebra.cpp: {fn} ends in "
            "at::_linalg_check_errors(info, ...), whose fast path "
            f"`if (!infos.any().item<bool>()) return;` is {_SYNC}")


HISTC = ("aten/src/ATen/native/cuda/SummaryOps.cu _histc_cuda_template: with min == max (the "
         "default 0, 0) it reads self.min() and self.max() on the host (.cpu() / .item()): "
         + _SYNC)
HISTC_RANGE = ("aten/src/ATen/native/cuda/SummaryOps.cu _histc_cuda_template: with min != max "
               "it uses them as given and launches CUDA_tensor_histogram, no host read")
BINCOUNT = ("aten/src/ATen/native/cuda/SummaryOps.cu _bincount_cuda_template: the bin count is "
            "self.max() read on the host: " + _SYNC)
NONZERO = ("aten/src/ATen/native/cuda/Nonzero.cu nonzero_out_cuda copies the number of nonzero "
           "elements to the host to size its output (torch tags the op dynamic_output_shape): "
           + _SYNC)
MASK_INDEX = ("aten/src/ATen/native/IndexingUtils.h expandTensors turns a boolean index into "
              "index.nonzero(), whose count is read on the host: " + _SYNC)
MULTINOMIAL = ("aten/src/ATen/native/Distributions.cpp multinomial_out: the fast path (no "
               "replacement, or one sample) validates the probabilities with at::_assert_async "
               "(a device-side assert, no host read; issue 37: since torch 2.6) and draws with "
               "exponential_ + argmax/topk from the default CUDA generator, which "
               "torch.cuda.graph registers itself")
CATEGORICAL = ("torch/distributions/categorical.py:148 sample() is torch.multinomial(probs_2d, "
               "n, True) with n = 1 for one sample (the fast path, see multinomial); "
               "validate_args=False skips torch/distributions/distribution.py:56-76")
VALIDATION = ("torch/distributions/distribution.py:27 `_validate_args = __debug__` (on by "
              "default); :75-76 `valid = constraint.check(value)` then "
              "`if not torch._is_all_true(valid)`: Python's bool of a device tensor, " + _SYNC)
HEALTH_CHECK = ("torch/optim/optimizer.py:448-475 _accelerator_graph_capture_health_check, "
                "called first in step() (torch/optim/adam.py:222, rmsprop.py:152): while the "
                "current stream captures and a param group has capturable=False it raises "
                "\"... but param_groups' capturable is False.\"")
CAPTURABLE = ("torch/optim/adam.py: capturable=True keeps `step` on the device and never reads "
              "it on the host (_multi_tensor_adam / _single_tensor_adam, capturable branches; "
              "the fused kernel takes it as a device tensor), and the health check "
              "(optimizer.py:448-475) passes; docs: 'capturable: whether this instance is safe "
              "to capture in a graph' "
              "(https://docs.pytorch.org/docs/stable/generated/torch.optim.Adam.html)")
SGD = ("torch/optim/sgd.py has no capture health check and keeps no host state; the docs' "
       f"whole-network capture example steps torch.optim.SGD inside the graph ({TORCH_DOCS})")
FROZEN = ("Python runs at capture only: a replay re-launches the recorded kernels with the "
          "arguments (Python numbers, tensor addresses) they had at capture, so a value that "
          "changes between calls is frozen at its capture value "
          f"({TORCH_DOCS}; 'stale scalars', 'CPU code within the graph region is skipped': "
          f"{NV_NUMERICAL})")
REBOUND = ("every replay reads and writes the addresses the capture saw: the tensor bound "
           "before the capture is read again by every replay, and the new binding made at "
           f"capture is never read by the graph ({TORCH_DOCS}; 'tensor reassignment': "
           f"{NV_NUMERICAL})")
SEED = ("aten/src/ATen/cuda/CUDAGeneratorImpl.cpp CUDAGeneratorImpl::set_current_seed: during a "
        "stream capture it is a no-op when the seed equals the generator's own and a "
        "TORCH_CHECK failure (\"can be called during stream capture only if new seed is the "
        "same as the original seed\") otherwise, reached from torch/random.py manual_seed -> "
        "torch/cuda/random.py manual_seed_all. The warm-up calls set the same seed, so the "
        "capture succeeds, but eager calls restart the philox offset at 0 on every call (the "
        "same numbers each call) while replays advance it: replays differ")
UNREGISTERED = ("aten/src/ATen/cuda/CUDAGeneratorImpl.cpp CUDAGeneratorState::increase: a "
                "generator not registered with the graph raises \"Attempt to increase offset "
                "for a CUDA generator not in capture mode.\"")
DEVICE_SYNC = ("torch/cuda/__init__.py:1209 synchronize -> torch._C._cuda_synchronize "
               "(cudaDeviceSynchronize), illegal while a stream captures: 'operation not "
               f"permitted when stream is capturing' ({CUDA_GUIDE}; {NV_CHECKLIST}: no explicit "
               "sync)")
STREAM_SYNC = ("torch/cuda/streams.py:102 Stream.synchronize wraps cudaStreamSynchronize; "
               "synchronizing the capturing stream is invalid and ends the capture "
               f"({CUDA_GUIDE}; {NV_CONSTRAINTS})")
D2H = ("aten/src/ATen/native/cuda/Copy.cu copy_kernel_cuda: a blocking copy between device "
       "and pageable host memory goes through at::cuda::memcpy_and_sync "
       "(c10/cuda/CUDAFunctions.h), a cudaStreamSynchronize that a capturing stream refuses "
       f"({NV_CHECKLIST}: no blocking GPU->CPU transfers)")
H2D = ("building a device tensor from Python or NumPy data copies pageable host memory to the "
       "device: torch/csrc/utils/tensor_new.cpp internal_new_from_data makes a CPU tensor and "
       "copies it with .to(device), which is aten/src/ATen/native/cuda/Copy.cu "
       f"copy_kernel_cuda -> memcpy_and_sync ({NV_CHECKLIST}: no direct CUDA tensor creation "
       "from Python objects)")
HOST_READ = f"a host read of device data ({TORCH_DOCS}: ops that sync the CPU with the GPU, " \
            f"e.g. .item(), are prohibited; {NV_CHECKLIST})"
CPU_OP = ("an op on a host tensor is CPU work: it runs once, at capture, and a replay (GPU "
          "work only) never repeats it; the 0-d host result enters the CUDA kernels as a "
          "scalar argument read at capture (aten/src/ATen/native/cuda/Loops.cuh "
          f"gpu_kernel_with_scalars) ({NV_NUMERICAL}: CPU code within the graph region is "
          "skipped)")
CPU_SCALAR = ("a 0-d CPU tensor is legal in a CUDA op: TensorIteratorBase treats it as a "
              "CPU scalar (is_cpu_scalar) and aten/src/ATen/native/cuda/Loops.cuh "
              "gpu_kernel_with_scalars passes its value as a kernel argument; the value is a "
              "constant, so every replay computes the same as an eager call")
ONE_HOT = ("aten/src/ATen/native/Onehot.cpp one_hot: on CUDA with num_classes given it checks "
           "only num_classes >= 1 and relies on scatter's device asserts ('rely on device "
           "asserts from scatter to avoid sync here')")
ONE_HOT_INFERRED = ("aten/src/ATen/native/Onehot.cpp one_hot: num_classes == -1 is "
                    "`self.max().item().toLong() + 1`: " + _SYNC)
MASKED_FILL = ("aten/src/ATen/native/TensorAdvancedIndexing.cpp _index_put_impl_: "
               "canDispatchToMaskedFill (TensorAdvancedIndexingUtils.h) sends a boolean mask "
               "with a one-element CPU value to masked_fill_, no nonzero; "
               "torch/csrc/autograd/python_variable_indexing.cpp THPVariable_setitem makes a "
               "Python scalar value on the CPU for a CUDA self so that it takes this path")
MASK_ASSIGN = ("aten/src/ATen/native/TensorAdvancedIndexing.cpp _index_put_impl_: a value that "
               "is not a one-element CPU tensor does not take the masked_fill path; the "
               "boolean mask goes through expandTensors (IndexingUtils.h), index.nonzero(), "
               "whose count is read on the host: " + _SYNC)
REPEAT = ("aten/src/ATen/native/Repeat.h repeat_interleave_common: with output_size given "
          "`total = output_size.value()` and no host read (docs: 'If given, it will avoid "
          "stream synchronization needed to calculate output shape of the tensor', "
          "https://docs.pytorch.org/docs/stable/generated/torch.repeat_interleave.html; "
          "pytorch/pytorch#58417)")
REPEAT_INFERRED = ("aten/src/ATen/native/Repeat.h repeat_interleave_common: without "
                   "output_size `total = cumsum[-1].item<int64_t>()`: " + _SYNC)
TO_DEVICE = ("Tensor.to(device) of a tensor already on that device returns it unchanged "
             "(aten/src/ATen/native/TensorConversions.cpp to -> to_impl: "
             "to_will_alias), no copy, no kernel")
STATIC_INT = ("a capture records kernels, not return values (torch/cuda/graphs.py:365 graph "
              "only brackets capture_begin / capture_end): a Python int that is the same on "
              f"every call (a shape, a constant) is what an eager call returns too ({TORCH_DOCS})")
INT_INDEX = ("indexing with a 0-d integer tensor reads it on the host: "
             "aten/src/ATen/TensorIndexing.h handleDimInMultiDimIndexing, "
             "`impl::applySelect(..., tensor.item<int64_t>(), ...)`: " + _SYNC)
LIST_INDEX = (f"{NV_CHECKLIST}: no GPU tensor indexing with CPU tensors or Python lists: the "
              "host index is copied to the device from pageable memory "
              "(Copy.cu copy_kernel_cuda -> memcpy_and_sync)")
LSTM = ("pytorch test/test_cuda.py test_graph_cudnn_dropout captures nn.LSTM(...).cuda() "
        "forward (parameters requiring grad) with torch.cuda.CUDAGraph capture_begin/end; "
        "aten/src/ATen/native/cudnn/RNN.cpp's DropoutState handles capture")
INFERENCE = ("torch.inference_mode only changes CPU-side dispatch (no autograd recording, no "
             "version counters: https://docs.pytorch.org/docs/stable/generated/"
             "torch.autograd.grad_mode.inference_mode.html); the kernels launched are the "
             "same as under no_grad, which the docs' capture examples use")
COALESCE = ("aten/src/ATen/native/sparse/cuda/SparseCUDATensor.cu _coalesce_sparse_cuda: the "
            "new nnz comes from a unique on the device and sizes the output on the host: "
            + _SYNC + "; torch.sparse.mm coalesces an uncoalesced input first "
            "(SparseCUDATensorMath.cu s_addmm_out_sparse_dense_cuda)")
NESTED = ("an elementwise op on a nested tensor runs one kernel over its contiguous buffer "
          "(aten/src/ATen/native/nested/NestedTensorUnaryOps.cpp, NestedTensor_elementwise / "
          "map_nt); the sizes stay host metadata, nothing is read from the device")
CAPTURE_FLAG = ("torch.cuda.is_current_stream_capturing() is True only during the capture "
                "(torch/cuda/graphs.py), so the guarded work is left out of the graph while "
                f"eager calls do it: a replay never does ({TORCH_DOCS})")
FUSED_HOST_LR = ("aten/src/ATen/native/cuda/FusedAdamKernel.cu, FusedAdamWKernel.cu, "
                 "FusedSgdKernel.cu: given a tensor lr with lr.is_cpu(), the fused step calls "
                 "the kernel with lr.item<double>(), read on the host at launch: a capture "
                 "records the value read then, so annealing the tensor between replays changes "
                 "nothing (torch/optim/adam.py _fused_adam moves only a device lr between "
                 "devices)")
CAPTURE_FLAG_READ = ("torch.cuda.is_current_stream_capturing() is True only during the capture "
                     "(torch/cuda/graphs.py): a host read it guards runs in eager calls and not "
                     "at capture, and what it reads changes nothing a replay computes (the "
                     f"read writes no tensor the graph holds) ({TORCH_DOCS})")
INVALIDATED = ("the host read inside the try raises at capture and invalidates the capture: "
               f"cudaStreamEndCapture then fails and the graph is never made ({CUDA_GUIDE}: an "
               "illegal operation invalidates the capture)")
PINNED = ("measured, against NVIDIA's checklist (no pinned memory allocation during capture): "
          "a real capture on an NVIDIA H100 (torch 2.11.0+cu130, 2026-11-25, "
          "results/real_capture_cuda.jsonl) accepted a pinned allocation that reuses a block "
          "the warm-up calls freed, and three replays matched eager calls bit for bit")
PINNED_ASYNC = ("aten/src/ATen/native/cuda/Copy.cu copy_kernel_cuda: a non_blocking device-to-host "
                "copy into pinned memory is a cudaMemcpyAsync on the current stream, which a "
                "capture records (no host wait)")
PINNED_BLOCKING = ("aten/src/ATen/native/cuda/Copy.cu copy_kernel_cuda: without non_blocking the "
                   "copy is at::cuda::memcpy_and_sync, which synchronizes the stream: illegal "
                   "during a capture, pinned destination or not")
SHAPE = ("shapes are fixed at capture: every replay computes the capture's shape while eager "
         f"calls follow the Python value ({TORCH_DOCS}: dynamic shapes are prohibited)")
CLIP = ("torch/nn/utils/clip_grad.py:109 `if error_if_nonfinite and "
        "torch.logical_or(total_norm.isnan(), total_norm.isinf()):` is Python's bool of a "
        "device tensor: " + _SYNC)
CLIP_OK = ("torch/nn/utils/clip_grad.py: with error_if_nonfinite=False (the default) the norm "
           "and the scaling stay on the device (_get_total_norm, _clip_grads_with_norm_, "
           "foreach ops), no host read")
CLEAN = (f"device ops only, no host read, no Python value that changes between calls "
         f"({TORCH_DOCS})")
RNG_OK = ("random ops on the default CUDA generator, which torch.cuda.graph registers (its "
          f"philox offset advances on every replay) ({TORCH_DOCS}: CUDA RNG ops are permitted)")
