"""Public whole-model training-step measurements that check the GPU class model
(``gpu_model.py``) above the GEMM level (``bench/gpu_layer_accuracy.py``).

Every row is one single-GPU run of BERT-large or BERT-base SQuAD fine-tuning from Lambda's
PyTorch benchmark (https://github.com/lambdal/deeplearning-benchmark), which
runs NVIDIA DeepLearningExamples' ``run_squad.py`` (the ``lambda/benchmark``
branch of LambdaLabsML/DeepLearningExamples, NGC PyTorch containers 20.01 to
22.09). The raw log of each run (``pytorch/results/<system>/
PyTorch_bert_{large,base}_squad_FP16/<date>.txt``, commit given per row)
states: the model (``MODELS``: BERT-large 24 x h1024, BERT-base 12 x h768,
uncased), ``--max_seq_length=384``, the per-GPU
``train_batch_size``, ``--fp16`` (apex AMP O2: float16 model, float32 master
weights, dynamic loss scaling), learning rate 0, one GPU. Each step is a
forward, a backward and an optimizer step (apex FusedAdam / BertAdam) of
``train_batch_size`` sequences; the run's tokenized SQuAD features are all
padded to 384 tokens.

Which number is taken: the log prints a timestamped line at training
iterations 1, 51, 101, ...; ``interval_s`` is the time between the iteration-51
line and the last one, ``interval_steps`` the steps between them, so
``step_s = interval_s / interval_steps`` is the steady-state step time (the
first 50 steps, with cuDNN/cuBLAS warm-up and the loss-scale search, are
left out). ``reported_seq_per_s`` is the log's own
``training_sequences_per_second`` (over all steps, warm-up included: a few
percent lower), kept for reference.

The BERT-large rows (``BERT_LARGE_SQUAD``) set one constant of the cost
model, ``gpu_model.UNFUSED_FRACTION`` (the fit split, [Note: unfused
fraction] in ``gpu_model.py``); the BERT-base rows (``BERT_BASE_SQUAD``) set
nothing and score it. Where the table row of the GPU has a measured
sustained GEMM rate, the "table" pricing uses it; the "class" pricing
ignores it (see the bench script).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["StepPoint", "MODELS", "BERT_LARGE_SQUAD", "BERT_BASE_SQUAD", "STEP_POINTS", "EXTRA_SPECS"]

_L = "https://github.com/lambdal/deeplearning-benchmark/blob"

#: The measured models, as ``bert_config.json`` of google-research/bert
#: defines them; ``logged_params``: the logs' ``model_weights_num`` (it
#: includes the pooler and a vocabulary padded to 30528, which the
#: captured model leaves out: 0.3% / 1% fewer parameters).
MODELS: dict[str, dict] = {
    "bert-large": dict(vocab_size=30522, hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                       intermediate_size=4096, seq_len=384, logged_params=335_150_082),
    "bert-base": dict(vocab_size=30522, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                      intermediate_size=3072, seq_len=384, logged_params=109_488_386),
}


@dataclass(frozen=True, slots=True)
class StepPoint:
    """One measured training step of a whole model on one GPU."""

    #: Key of ``MODELS``.
    model: str
    #: ``gpu_specs.csv`` type, or a key of ``EXTRA_SPECS``.
    gpu: str
    #: Sequences per step (one micro-batch, no gradient accumulation).
    micro_batch: int
    #: Seconds between the two timestamped log lines read.
    interval_s: float
    #: Optimizer steps between those lines.
    interval_steps: int
    #: The log's ``training_sequences_per_second`` (warm-up included); None
    #: where the log's own figure disagrees with its step timestamps (noted).
    reported_seq_per_s: float | None
    #: Repository file and commit of the raw log, and the lines read.
    source: str

    @property
    def step_s(self) -> float:
        """Steady-state seconds per step (forward + backward + optimizer)."""
        return self.interval_s / self.interval_steps


def _src(system: str, log: str, commit: str, lines: str, model: str = "large") -> str:
    return f"{_L}/{commit}/pytorch/results/{system}/PyTorch_bert_{model}_squad_FP16/{log} ({lines})"


_TURING = ("Turing tensor cores run FP16 with FP32 accumulate at 8x the FP32 rate on Quadro/Titan parts "
           "(NVIDIA Turing GPU architecture whitepaper, "
           "https://images.nvidia.com/aem-dam/en-zz/Solutions/design-visualization/technologies/turing-architecture/"
           "NVIDIA-Turing-Architecture-Whitepaper.pdf)")


BERT_LARGE_SQUAD: tuple[StepPoint, ...] = (
    StepPoint("bert-large", "V100-16GB", 16, 13.509492, 50, 57.8655,
              _src("LambdaCloud_V100_16GB_v1", "16-12-2022_02-59-50.txt", "e65ebf70a0e3f50fa5c2edc6fabcc18cf6908b0c",
                   "iteration 51 at 03:00:44.200610, 101 at 03:00:57.710102; 5541 steps/epoch of 88641 "
                   "features = batch 16; Lambda Cloud V100 16GB instance, 300 W per GPU in "
                   "Lambda's pytorch-train-throughput-fp16.csv: the SXM2 card)")),
    StepPoint("bert-large", "A10", 28, 32.028117, 50, 42.4548,
              _src("LambdaCloud_A10_v1", "10-02-2023_01-39-44.txt", "4a985cd0ade7d30c00bfa9aa8b93f9a628a1e3d5",
                   "iteration 51 at 01:40:49.948753, 101 at 01:41:21.976870; 3166 steps/epoch = batch 28")),
    StepPoint("bert-large", "A40", 36, 90.747265, 150, 57.6025,
              _src("A40", "26-06-2021_16-04-30.txt", "ebe6157492702c9ddd49881a18a7080ac4c825ec",
                   "iteration 51 at 16:05:31.985869, 201 at 16:07:02.733134; train_batch_size 36")),
    StepPoint("bert-large", "A100-PCIE-40GB", 48, 20.201503, 50, 115.8761,
              _src("A100_40GB_PCIe_v1", "24-10-2022_05-26-56.txt", "bee47dae0e3b29907faf20dda7b018aaaba41995",
                   "iteration 51 at 05:27:45.503183, 101 at 05:28:05.704686; train_batch_size 48")),
    StepPoint("bert-large", "A100-40GB", 32, 14.270221, 50, 107.1268,
              _src("A100_SXM4", "04-11-2020_21-22-32.txt", "e167f02cb45d83ccbc4b322dd33773e30ecfd100",
                   "iteration 51 at 21:23:14.756846, 101 at 21:23:29.027067; train_batch_size 32; "
                   "system 'A100 40GB SXM4' in compile_results_pytorch_throughput.py")),
    StepPoint("bert-large", "RTX-A6000", 36, 83.961707, 150, 63.7924,
              _src("A6000", "01-01-2021_17-41-40.txt", "e167f02cb45d83ccbc4b322dd33773e30ecfd100",
                   "iteration 51 at 17:42:36.090419, 201 at 17:44:00.052126; train_batch_size 36")),
    StepPoint("bert-large", "RTX-3090", 28, 26.415371, 50, 52.5676,
              _src("3090_v1", "24-10-2022_23-09-38.txt", "835c4479afd850f025e4dcb67238a06a004c6548",
                   "iteration 51 at 23:10:26.994406, 101 at 23:10:53.409777; 3166 steps/epoch = batch 28")),
    StepPoint("bert-large", "RTX-3080", 4, 6.347623, 50, 29.9469,
              _src("3080", "28-10-2020_05-21-22.txt", "e167f02cb45d83ccbc4b322dd33773e30ecfd100",
                   "iteration 51 at 05:21:49.489289, 101 at 05:21:55.836912; train_batch_size 4 (10 GB card)")),
    StepPoint("bert-large", "Quadro-RTX-8000", 64, 63.699150, 50, 50.2665,
              _src("QuadroRTX8000_v1", "14-12-2022_21-58-09.txt", "b2c88c568571539b37748efd1557b88f7de99486",
                   "iteration 51 at 22:00:01.795245, 101 at 22:01:05.494395; 1386 steps/epoch = batch 64")),
    StepPoint("bert-large", "GTX-1080Ti", 4, 96.0, 200, None,
              _src("1080Ti", "03-03-2020_10-35-27.txt", "e167f02cb45d83ccbc4b322dd33773e30ecfd100",
                   "iteration 51 at 10:36:08, 251 at 10:37:44 (1 s resolution); 'Batch size = 4'; container "
                   "20.01; the log's closing 'training throughput: 9.8' disagrees with its timestamps and its "
                   "own progress rate (2.08 it/s x 4 = 8.3 seq/s) and is not used")),
)

BERT_BASE_SQUAD: tuple[StepPoint, ...] = (
    StepPoint("bert-base", "V100-16GB", 48, 12.397012, 50, 189.9359,
              _src("LambdaCloud_V100_16GB_v1", "16-12-2022_03-24-04.txt", "e7fc97854b8f58bb7678f3d2d13d412952aa11e5",
                   "iteration 51 at 03:24:47.514845, 101 at 03:24:59.911857; 1847 steps/epoch = batch 48", "base")),
    StepPoint("bert-base", "A10", 80, 28.761356, 50, 135.3426,
              _src("LambdaCloud_A10_v1", "11-02-2023_04-55-32.txt", "4a985cd0ade7d30c00bfa9aa8b93f9a628a1e3d5",
                   "iteration 51 at 04:56:41.594923, 101 at 04:57:10.356279; 1109 steps/epoch = batch 80", "base")),
    StepPoint("bert-base", "A40", 108, 87.592064, 150, 179.6075,
              _src("A40", "26-06-2021_16-51-16.txt", "ebe6157492702c9ddd49881a18a7080ac4c825ec",
                   "iteration 51 at 16:52:13.473192, 201 at 16:53:41.065256; train_batch_size 108", "base")),
    StepPoint("bert-base", "A100-PCIE-40GB", 160, 21.412122, 50, 365.5323,
              _src("A100_40GB_PCIe_v1", "24-10-2022_05-29-32.txt", "5ea59c707f7ad02e17b1aa3570ff1834e5a982ee",
                   "iteration 51 at 05:30:18.901540, 101 at 05:30:40.313662; 555 steps/epoch = batch 160", "base")),
    StepPoint("bert-base", "RTX-3090", 96, 27.596917, 50, 172.1978,
              _src("3090_v1", "24-10-2022_23-35-09.txt", "e65ebf70a0e3f50fa5c2edc6fabcc18cf6908b0c",
                   "iteration 51 at 23:35:56.743408, 101 at 23:36:24.340325; 924 steps/epoch = batch 96", "base")),
    StepPoint("bert-base", "Quadro-RTX-8000", 192, 65.393010, 50, 146.5463,
              _src("QuadroRTX8000_v1", "14-12-2022_22-23-52.txt", "e65ebf70a0e3f50fa5c2edc6fabcc18cf6908b0c",
                   "iteration 51 at 22:25:42.224547, 101 at 22:26:47.617557; 462 steps/epoch = batch 192", "base")),
)

#: Every measured step, BERT-large first.
STEP_POINTS: tuple[StepPoint, ...] = BERT_LARGE_SQUAD + BERT_BASE_SQUAD

#: GPUs of ``STEP_POINTS`` that are not rows of ``gpu_specs.csv``:
#: ``{gpu: (arch, memory GiB, GB/s, FP32 TFLOP/s, dense FP16-FP32acc tensor TFLOP/s, TDP W, source)}``.
EXTRA_SPECS: dict[str, tuple[str, float, float, float, float, float, str]] = {
    "RTX-3080": ("ampere-ga10x-geforce", 10, 760.0, 29.8, 59.5, 320.0,
                 "https://www.nvidia.com/content/PDF/nvidia-ampere-ga-102-gpu-architecture-whitepaper-v2.pdf "
                 "(GA102 whitepaper, RTX 3080 column: 10 GB GDDR6X, 760 GB/s, FP32 29.8, FP16 tensor with "
                 "FP32 accumulate 59.5 dense, 320 W; the same figures as reference_data.HELDOUT_PEAKS)"),
    "Quadro-RTX-8000": ("turing", 48, 672.0, 16.3, 130.4, 295.0,
                        "https://huggingface.co/hardware/quadro-rtx-8000 (48 GB, 32.63 TFLOPS FP16 non-tensor = "
                        "2 x FP32, 295 W); https://chip.pl/2018/10/bestia-dla-profesjonalistow-quadro-rtx-6000 "
                        "(same TU102 configuration: FP32 16.3); https://geektopia.es/es/technology/2018/08/14/"
                        "noticias/nvidia-anuncia-las-tres-primeras-quadro-rtx-que-usan-la-nueva-gpu-turing.html "
                        "(14 Gb/s GDDR6 on 384 bits = 672 GB/s); tensor = 8 x 16.3: " + _TURING),
    "GTX-1080Ti": ("pascal", 11, 484.0, 11.34, 11.34, 250.0,
                   "https://www.nvidia.com/en-us/geforce/graphics-cards/geforce-gtx-1080-ti/specifications/ "
                   "(3584 CUDA cores x 2 x 1582 MHz boost = 11.34 TFLOPS FP32; 11 Gbps GDDR5X on 352 bits = "
                   "484 GB/s; 250 W; vendor page not in the stored corpus: cores and bus width agree with "
                   "https://techpowerup.com/reviews/ASUS/GTX_1080_Ti_Strix_OC). No tensor cores and 1/64-rate "
                   "FP16 math: a 16-bit GEMM with FP32 compute runs at the FP32 rate, so the 16-bit column "
                   "holds the FP32 peak (the class model uses the FP32 peak on Pascal anyway)"),
}
