"""Packed documents under every context-parallel layout equal the single-process fp32 reference: loss (1e-5)
and every gradient (1e-4) over two optimizer steps, in one 4-rank gloo launch. The ring cut by documents
(`--cp-document-layout split`: each document head-tail over the ring; `local`: short documents whole on one ring
rank, never sent) alone, under an all-to-all level, with data parallelism, and with the memory stack (full
recompute, offload, kept attention, tiled MLP and loss); samples of one document, of documents that all fit one
rank, and of documents longer than a rank's share."""

import pytest

from megatron_lc.models.llama import get_config
from tests.exactness import check_against_reference, checks_that_ran
from tests.helpers import parallelize_options

DEBUG = get_config("debug")  # 8 heads, 2 kv heads
S = 64
MIXED = [6, 30, 1, 3, 9, 15]
"""One document longer than a rank's share (16 tokens on 4 ring ranks), one of a single token."""
FIT_ONE_RANK = [4] * 16
"""Every document fits one rank: `local` keeps them all home."""
ONE_DOCUMENT = [S]
STACK = dict(recompute_granularity="full", offload_mode="prefetch", keep_attention_output=True, mlp_tiles=3,
             loss_tiles=5)


def _batch(*samples):
    return dict(num_samples=len(samples), seq_length=S, vocab=512, seed=1, ignore_fraction=0.4,
                documents=[list(s) for s in samples])


ARGS = {  # name -> check_against_reference's arguments after (rank, world): config, cp, options, batch, steps,
    # ring, micro-batches
    "ring4-local": (DEBUG, 4, parallelize_options(cp_documents="local"), _batch(MIXED, FIT_ONE_RANK), 2, 4),
    "ring4-split-stack": (DEBUG, 4, parallelize_options(cp_documents="split", ring_kv_grads="in_place", **STACK),
                          _batch(ONE_DOCUMENT, MIXED), 2, 4),
    **{f"a2a+p2p-{cp_impl}-{documents}": (DEBUG, 4, parallelize_options(cp_documents=documents, cp_impl=cp_impl,
                                                                         **STACK), _batch(MIXED, FIT_ONE_RANK), 2, 2)
       for cp_impl, documents in (("untied_ulysses", "split"), ("ulysses", "local"))},
    "dp2-ring2-local-micro-batches": (DEBUG, 2, parallelize_options(cp_documents="local", **STACK),
                                      _batch(MIXED, FIT_ONE_RANK, ONE_DOCUMENT, [40, 24]), 2, 2, 2),
}


@pytest.fixture(scope="module")
def checked():
    """Every check of this file (`ARGS`) in one 4-rank gloo launch: the names of those that ran."""
    return checks_that_ran({4: {name: (check_against_reference, args) for name, args in ARGS.items()}})


def test_ring_keeping_short_documents_home_matches_single_process(checked):
    """p2p ring of 4 (`local`), no memory stack: one sample of mixed documents, one of documents that each fit a
    rank (all kept home: none of its rows travels)."""
    assert "ring4-local" in checked


def test_ring_cutting_every_document_with_the_memory_stack_matches_single_process(checked):
    """p2p ring of 4 (`split`), full recompute + offload + kept attention + tiled MLP and loss, accumulators
    rotated in place; a sample of one document beside a mixed one."""
    assert "ring4-split-stack" in checked


@pytest.mark.parametrize("cp_impl,documents", [("untied_ulysses", "split"), ("ulysses", "local")])
def test_all_to_all_pairs_in_a_ring_cut_by_documents_match_single_process(cp_impl, documents, checked):
    """a2a+p2p 2 x 2 with the memory stack: the all-to-all gathers a ring rank's pieces of every document."""
    assert f"a2a+p2p-{cp_impl}-{documents}" in checked


def test_local_documents_with_data_parallel_and_micro_batches_match_single_process(checked):
    """dp 2 x ring 2, two micro-batches a rank: each micro-batch's samples cut by their own documents."""
    assert "dp2-ring2-local-micro-batches" in checked
