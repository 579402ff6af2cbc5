"""The rank side: what one rank does (its entry, the kind of run, the Lightning task and Trainer, callbacks,
loggers, results). It never imports the job side (``disttrain.launch``)."""
