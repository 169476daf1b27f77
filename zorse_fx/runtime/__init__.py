"""Runtime: executes an exported plan on torch.distributed (NCCL on GPU, Gloo on
CPU). The schedule and point-to-point program it executes are data in
``zorse_fx.ir`` (``ir.schedule``, ``ir.p2p``); this package holds their
executors: ``worker`` (one rank's training loop), ``stage`` (a stage module and
its boundary tensors), ``p2p`` (``batch_isend_irecv`` groups), ``grad_sync``
(bucketed all-reduce), ``optimizer`` (AdamW, ZeRO-1, loss scaling),
``checkpoint`` and ``launch`` / ``watchdog`` (torchrun and job control)."""
