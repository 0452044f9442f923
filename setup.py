"""Builds the compiled hot path. The extension is mandatory: no pure-Python fallback ships."""
from Cython.Build import cythonize
from setuptools import Extension, setup

setup(
    ext_modules=cythonize(
        [Extension("router._fastpath", ["router/_fastpath.pyx"], extra_compile_args=["-O2"])],
        language_level=3,
        compiler_directives={"boundscheck": False, "wraparound": False, "cdivision": True},
    )
)
