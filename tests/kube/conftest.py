from tests.kube.fixtures import kube_emulator, kube_emulator_module  # noqa: F401
