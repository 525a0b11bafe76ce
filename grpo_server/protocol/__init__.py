"""What the front end, the sampler and the learner share: the wire types and verbs, the error shape, msgpack,
the readers-writer gate and the workers' config. Imports no ML library and no other part of the front end."""
