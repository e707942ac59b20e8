"""Build script: the package is pure Python; C++ helpers in csrc/ are built only when present
and a compiler is available (they are optional accelerations of measured hot loops)."""
import glob
import os

from setuptools import setup

ext_modules = []
sources = sorted(glob.glob(os.path.join("csrc", "*.cpp")))
if sources and os.environ.get("MIRAGE_BUILD_CSRC", "1") != "0":
    from setuptools import Extension

    ext_modules.append(Extension("torch_mirage._C", sources=sources, extra_compile_args=["-O3", "-std=c++17"],
                                 optional=True))

setup(ext_modules=ext_modules)
