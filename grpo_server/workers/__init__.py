"""The front end's side of the sampler and learner processes: connections, replica choice and turns (`pool`),
configs and start-up (`launch`), local processes (`processes`), workers on other hosts (`remote`)."""
