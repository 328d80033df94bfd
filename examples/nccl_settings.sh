# NCCL settings every recipe sources, whatever its launcher (torchrun, srun, mpirun), so that every
# rank runs with the values the memory plan assumes. A value set before the recipe runs is kept.
# NCCL_VARIABLES lists what is set, for launchers that forward variables by name (mpirun -x).

# NCCL's buffers are part of the plan: 16 channels (ring and all-to-all peers) instead of NCCL's
# 32 on 8xH100 keep the all-to-all peer buffers at ~2 GiB per GPU. NCCL_BUFFSIZE is NCCL's default.
export NCCL_MAX_NCHANNELS=${NCCL_MAX_NCHANNELS:-16}
export NCCL_BUFFSIZE=${NCCL_BUFFSIZE:-4194304}
# NVLS (NVLink SHARP) off: the memory plan does not model its buffers; these steps are all-to-all/p2p bound.
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
# WARN: NCCL's errors and warnings only; INFO prints its topology and chosen interfaces (the first thing
# to read when a multi-node job hangs at start-up); add NCCL_DEBUG_SUBSYS=INIT,NET to narrow it.
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
NCCL_VARIABLES=(NCCL_MAX_NCHANNELS NCCL_BUFFSIZE NCCL_NVLS_ENABLE NCCL_DEBUG)
# Site-specific, so unset unless given: NCCL_SOCKET_IFNAME names the interface of NCCL's bootstrap
# and socket traffic (e.g. =ib0, or =^docker,lo to exclude), NCCL_IB_HCA the InfiniBand adapters
# (e.g. =mlx5_0,mlx5_1,... on a DGX H100's compute fabric, leaving out the storage ones). Forwarded
# to every rank when set.
for name in NCCL_SOCKET_IFNAME NCCL_IB_HCA NCCL_DEBUG_SUBSYS; do
    if [ -n "${!name:-}" ]; then
        export "${name?}"
        NCCL_VARIABLES+=("$name")
    fi
done
