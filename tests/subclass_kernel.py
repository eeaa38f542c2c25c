"""A real Jupyter kernel whose shell is a subclass of ipykernel's ZMQInteractiveShell.

Built the way Colab builds its own (``google.colab._kernel.Kernel``, an
IPythonKernel, makes ``google.colab._shell.Shell``, a ZMQInteractiveShell
subclass, its ``shell_class``), so a kernel-side check that looks at the class name rather than
the class sees a shell it does not know. Run by tests/test_stacks.py
through a kernelspec of its own:

    python tests/subclass_kernel.py -f CONNECTION_FILE
"""

from __future__ import annotations

from ipykernel.ipkernel import IPythonKernel
from ipykernel.kernelapp import IPKernelApp
from ipykernel.zmqshell import ZMQInteractiveShell
from traitlets import Type


class SubclassShell(ZMQInteractiveShell):
    """A notebook shell with a class name of its own, as Colab's ``Shell``."""


class SubclassKernel(IPythonKernel):
    shell_class = Type(SubclassShell)


if __name__ == "__main__":
    IPKernelApp.launch_instance(kernel_class=SubclassKernel)
