"""Packed documents under every context-parallel layout equal the single-process fp32 reference: loss (1e-5)
and every gradient (1e-4) over two optimizer steps, 4-rank gloo runs. The ring cut by documents
(`--cp-document-layout split`: each document head-tail over the ring; `local`: short documents whole on one ring
rank, never sent) alone, under an all-to-all level, with data parallelism, and with the memory stack (full
recompute, offload, kept attention, tiled MLP and loss); samples of one document, of documents that all fit one
rank, and of documents longer than a rank's share."""

import pytest

from megatron_lc.models.llama import get_config
from tests.exactness import check_against_reference
from tests.helpers import parallelize_options, run_distributed

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


def test_ring_keeping_short_documents_home_matches_single_process():
    """p2p ring of 4 (`local`), no memory stack: one sample of mixed documents, one of documents that each fit a
    rank (all kept home: none of its rows travels)."""
    run_distributed(check_against_reference, 4, DEBUG, 4, parallelize_options(cp_documents="local"),
                    _batch(MIXED, FIT_ONE_RANK), 2, 4)


def test_ring_cutting_every_document_with_the_memory_stack_matches_single_process():
    """p2p ring of 4 (`split`), full recompute + offload + kept attention + tiled MLP and loss, accumulators
    rotated in place; a sample of one document beside a mixed one."""
    opts = parallelize_options(cp_documents="split", ring_kv_grads="in_place", **STACK)
    run_distributed(check_against_reference, 4, DEBUG, 4, opts, _batch(ONE_DOCUMENT, MIXED), 2, 4)


@pytest.mark.parametrize("cp_impl,documents", [("untied_ulysses", "split"), ("ulysses", "local")])
def test_all_to_all_pairs_in_a_ring_cut_by_documents_match_single_process(cp_impl, documents):
    """a2a+p2p 2 x 2 with the memory stack: the all-to-all gathers a ring rank's pieces of every document."""
    opts = parallelize_options(cp_documents=documents, cp_impl=cp_impl, **STACK)
    run_distributed(check_against_reference, 4, DEBUG, 4, opts, _batch(MIXED, FIT_ONE_RANK), 2, 2)


def test_local_documents_with_data_parallel_and_micro_batches_match_single_process():
    """dp 2 x ring 2, two micro-batches a rank: each micro-batch's samples cut by their own documents."""
    samples = (MIXED, FIT_ONE_RANK, ONE_DOCUMENT, [40, 24])
    run_distributed(check_against_reference, 4, DEBUG, 2, parallelize_options(cp_documents="local", **STACK),
                    _batch(*samples), 2, 2, 2)
