# Sourced by tests/mpi_test.sh and the scripts it runs (mpi_t5_test.sh, mpi_blip2_test.sh, mpi_sp_test.sh): the
# environment of their mpirun calls.
# Open MPI refuses root without these; more ranks than cores needs oversubscription.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
# one OpenMP thread per rank: the ranks share the machine's cores
export OMP_NUM_THREADS=1
# Start-up (the stage launches ~150 jobs of well under a second each): every rank on one node talks over shared
# memory (vader), so only the components that uses are opened - not the network / InfiniBand / UCX ones Open MPI
# probes by default - PMIx keeps the job's data in a hash table instead of a shared-memory store it first clears,
# and hwloc skips the PCI scan (config reads through the kernel). Measured (Open MPI 4.1.4, 2 busy Zen 3 cores,
# 6 x `mpirun -np 2` of MPI_Init + MPI_Finalize): 0.18 -> 0.12 CPU s a job, 0.5 -> 0.2 s wall. tests/netns_test.sh
# (TCP between namespaces) names its own btl on the command line, which the environment does not override.
# What the code under test does is unchanged: these select Open MPI's transport modules, not fitllm's paths.
export OMPI_MCA_pml=ob1 OMPI_MCA_btl=self,vader OMPI_MCA_mtl=^ofi,psm,psm2 OMPI_MCA_osc=sm,pt2pt
export PMIX_MCA_gds=hash HWLOC_COMPONENTS=-pci,-opencl,-cuda,-nvml,-rsmi,-levelzero
