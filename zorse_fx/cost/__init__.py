"""The cost model: per-block time and memory of one training step on each GPU
type (``BlockCosts``), from measured kernel profiles (``measured``, reading
``profile`` files and replaying a model's calls with ``replay``) or, for GPU
types without one, the per-class roofline model (``roofline``, ``gpu_model``);
activation memory measured under the plan's autocast (``activations``)."""
