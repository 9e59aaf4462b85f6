"""The HTTP routes, one module per surface: ``openai`` (completions and chat), ``llama_server`` (llama-server's
own routes) and ``probes`` (health, metrics, models, the live page).  Each is thin: it reads the body through
``schema``, turns it into jobs (``jobs``), runs them (``session``) and shapes the answer (``responses``,
``streams``, ``native``).  No route module imports another; ``app.create_app`` includes them all."""
