# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""llama.cpp bound directly: a Model, a Context with one KV cache shared by all sequences, and a
batch step that decodes and samples every sequence with the GIL released.

One extension module, its parts in the include files beside it, by concern:
  model.pxi        Model (a GGUF file, its vocabulary and metadata), the errors, llama.cpp's log
  context.pxi      Context: creating it, sequences and their KV cells, step() and decode_run()
  step.pxi         one step: its rows checked, planned into llama_decode calls, decoded, sampled
  decode_runs.pxi  decode_run's steps in C, constrained rows handed to after_step between them
  samplers.pxi     each sequence's samplers: the slot sampler in the graph (slot_sampler.c), the
                   row sampler on the host (row_sampler.c), RowSampler, ParkedSampler
  sampling.pxi     a step's outputs sampled: on the device or spread over host threads; greedy,
                   bitmask and log-probability helpers, Logprobs
  embedder.pxi     Embedder: pooled embeddings in a llama_context of their own
Cython includes files at module level only, so the parts of Context kept out of its class body
are module-level cdef functions that take the Context as `self`: C calls, as its cdef methods
were, with no Python call in between."""
import mmap
import os
import secrets
from array import array
from collections import namedtuple

from cllm.config import usable_cores

from cpython cimport array as carray
from cython.parallel cimport prange, threadid
from libc.math cimport expf, logf, sqrt, INFINITY
from libc.stdint cimport int32_t, uint8_t, uint32_t
from libc.stdio cimport fputs, stderr
from libc.stdlib cimport calloc, free, malloc

from cllm.llama._llama cimport *

# What carray.clone copies the item type of, for the arrays handed back to Python.
cdef carray.array _INT_ARRAY = array("i")
cdef carray.array _FLOAT_ARRAY = array("f")

include "model.pxi"
include "context.pxi"
include "step.pxi"
include "decode_runs.pxi"
include "samplers.pxi"
include "sampling.pxi"
include "embedder.pxi"
