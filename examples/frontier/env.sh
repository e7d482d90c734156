# shellcheck shell=bash
# The software environment for this project on Frontier (OLCF: HPE Cray EX, 4 AMD MI250X
# = 8 GCDs per node, Slingshot-11 with 4 NICs per node). Sourced by build.sh (to build the
# venv, with REFT_ENV_NO_VENV=1) and by llama2_34b.sbatch (to run in it).
#
# What to change: VENV (where build.sh put the venv; its default names <<PROJECT>>),
# AWS_OFI_RCCL_DIR, and the module versions when OLCF's software stack moves (the
# ROCm of the rocm module and of the torch wheel must agree: see build.sh). The settings
# below follow OLCF's guidance for RCCL and PyTorch on Frontier at the time of writing;
# check the current Frontier user guide when something hangs or is slow.
# Every variable set here honours a value already in the environment.

# ---- modules -------------------------------------------------------------------------
# GNU compilers for the C++ part of reft_ext._C (pybind11; the Cray cc/CC wrappers are
# not needed, setuptools calls the compiler directly)
module load PrgEnv-gnu
# the HIP runtime and hipcc; sets ROCM_PATH, which csrc/setup_ext.py links against
module load "rocm/${ROCM_MODULE_VERSION:-6.2.4}"
# MI250X = gfx90a: makes the Cray wrappers and anything built with them target it
module load craype-accel-amd-gfx90a
# a Python for `python -m venv` (build.sh); the venv then carries its own
module load miniforge3

# ---- the venv made by build.sh ---------------------------------------------------------
# On a project filesystem (NFS, /ccs/proj), not Lustre: thousands of ranks importing
# torch read many small files, which Lustre's metadata servers serve slowly.
VENV=${VENV:-/ccs/proj/<<PROJECT>>/${USER:-$(id -un)}/reft-venv}
export VENV
if [[ ${REFT_ENV_NO_VENV:-0} != 1 ]]; then
    if [[ ! -f $VENV/bin/activate ]]; then
        echo "env.sh: no venv at VENV=$VENV: run examples/frontier/build.sh first" >&2
        return 1
    fi
    # shellcheck disable=SC1091
    source "$VENV/bin/activate"
fi

# ---- RCCL over Slingshot ---------------------------------------------------------------
# aws-ofi-rccl is RCCL's network plugin for libfabric (Slingshot's CXI provider). RCCL
# (bundled in the ROCm torch wheel) loads librccl-net.so from LD_LIBRARY_PATH; without
# it RCCL falls back to TCP sockets between nodes, several times slower. Build it from
# ROCm/aws-ofi-rccl against the loaded libfabric, or use a build your site provides.
# Check once with NCCL_DEBUG=INFO: the node logs must show "NET/OFI", not "NET/Socket".
AWS_OFI_RCCL_DIR=${AWS_OFI_RCCL_DIR:-<<AWS_OFI_RCCL_DIR>>}
if [[ -f $AWS_OFI_RCCL_DIR/lib/librccl-net.so ]]; then
    export LD_LIBRARY_PATH=$AWS_OFI_RCCL_DIR/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
else
    echo "env.sh: WARNING: no librccl-net.so in AWS_OFI_RCCL_DIR=$AWS_OFI_RCCL_DIR:" \
        "RCCL will use TCP sockets between nodes" >&2
fi
# RCCL reads NCCL's variable names. Its bootstrap (and fallback) sockets on the
# high-speed network, not the node-management Ethernet the host name resolves to.
export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-hsn0}
# gloo carries REFT's own traffic: the health check, the slices exchanged at REFT-load
# and AOR's per-step gradient (~268 MB per rank for the 34B layout). Same network.
export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-hsn0}
# let a ring use a different NIC on each node (4 NICs per node): faster on large jobs
export NCCL_CROSS_NIC=${NCCL_CROSS_NIC:-1}
# GPU-direct RDMA between GCD memory and the NIC; remove it if a hang or crash appears
export NCCL_NET_GDR_LEVEL=${NCCL_NET_GDR_LEVEL:-3}
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
# libfabric's CXI provider: the memory-registration cache monitor (kdreg2; userfaultfd on
# older stacks) avoids a deadlock with RCCL's registrations; larger completion and
# transmit queues and hybrid matching (software when the NIC's lists overflow) keep
# large collectives from failing under load.
export FI_MR_CACHE_MONITOR=${FI_MR_CACHE_MONITOR:-kdreg2}
export FI_CXI_DEFAULT_CQ_SIZE=${FI_CXI_DEFAULT_CQ_SIZE:-131072}
export FI_CXI_DEFAULT_TX_SIZE=${FI_CXI_DEFAULT_TX_SIZE:-2048}
export FI_CXI_RX_MATCH_MODE=${FI_CXI_RX_MATCH_MODE:-hybrid}

# ---- torch on ROCm ---------------------------------------------------------------------
# What the watchdog does when a collective fails (TORCH_NCCL_ASYNC_ERROR_HANDLING, same
# name on ROCm) depends on the restart mode: examples/slurm/reft_job.sh sets it for
# RESTART (in-process: 0, the survivors stay; torchrun: 1, the agent restarts them).
# megatron-core's TP/SP communication overlap relies on in-order kernel issue; it checks
# this variable on ROCm builds too
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
# MIOpen (ROCm's DNN library) keeps tuned kernels in a SQLite database and a compiled-
# kernel cache under $HOME by default: hundreds of ranks locking one file on a shared
# filesystem fail or hang. A node-local private directory per job instead: launch_node.sh
# makes one on every node (mktemp -d in node-local ${TMPDIR:-/tmp}: 0700, a fresh
# unpredictable name, so none made first by another user is ever used), points both
# variables at it and removes it when the node's task ends. Set MIOPEN_USER_DB_PATH
# yourself to keep the cache elsewhere (it must be a directory of your own).
export REFT_MIOPEN_NODE_CACHE=${REFT_MIOPEN_NODE_CACHE:-1}
# 56 of a node's 64 cores are usable (8 are kept for the system), 7 per rank: data
# loading, REFT's host copies and AOR's Adam replay of a peer's shard run on them
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-7}
# the GPU target of anything compiled later (torch extensions, and reft_ext._C: csrc/setup_ext.py
# passes each as hipcc --offload-arch)
export PYTORCH_ROCM_ARCH=${PYTORCH_ROCM_ARCH:-gfx90a}
