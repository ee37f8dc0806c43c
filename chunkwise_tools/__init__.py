"""Tools around a chunkwise deployment, apart from the SDK: the local stack launcher (`serve`),
the fault-injecting soak (`soak`) and the load tester (`loadtest`)."""
