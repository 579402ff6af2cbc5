"""Pipeline parallelism: cutting a model into stages (``split``) and running a schedule over them (``runtime``)."""
