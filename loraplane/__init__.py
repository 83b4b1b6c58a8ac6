"""loraplane: many LoRA fine-tunes of one base model, served from shared GPU pods on Kubernetes.

Import names map onto the repository's top-level folders (see pyproject.toml):
``loraplane.kernels`` -> kernels/, ``loraplane.server`` -> server/, ``loraplane.operator`` -> operator/.
"""

__version__ = "0.1.0"
