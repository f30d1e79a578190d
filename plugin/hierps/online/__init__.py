"""The online loop: a stream of log files in, passes trained, fresh rows published for serving."""
