"""loraplane: many LoRA fine-tunes of one base model, served from shared GPU pods on Kubernetes.

Parts, from the bottom up: ``kernels`` (Triton multi-LoRA ops), ``artifacts`` (torch-free supply chain),
``engine`` (the serving engine), ``http`` (OpenAI, admin and metrics APIs), ``serve`` (the pod's process),
``operator`` (the kopf operator, which reaches pods over HTTP only).
"""

__version__ = "0.1.0"
