"""Where an API key may go: a key is sent only to the host its variable's name says it is for.

    api_key_env unset ........ the provider's own variable when base_url is a known provider
                               (OPENAI_API_KEY for OpenAI's API), else no key at all
    api_key_env OPENAI_API_KEY and base_url http://my-vllm:8000/v1
                               refused before the run starts (the name says OpenAI, the URL
                               does not), unless the model sets allow_key_to_other_host: true
    api_key_env MY_VLLM_KEY .. a name that claims no provider: sent where the config says

A server on this machine (127.0.0.1, localhost) needs no key: an unset variable sends a
placeholder. The openai package itself would read OPENAI_API_KEY and OPENAI_BASE_URL from
the environment when given none; the client here always passes both explicitly.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Mapping
from urllib.parse import urlparse

from evoattn.config import ModelConfig
from evoattn.errors import UsageError

OPENAI_URL = "https://api.openai.com/v1"
NO_KEY = "no-key"                      # what a keyless server receives as the bearer token
_LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")


@dataclasses.dataclass(frozen=True)
class Provider:
    """A hosted API: its hosts (a suffix match) and the names of its key variables."""

    name: str
    hosts: tuple[str, ...]
    key_names: re.Pattern[str]
    default_env: str


PROVIDERS = (
    Provider("OpenAI", ("api.openai.com",), re.compile(r"^OPENAI_"), "OPENAI_API_KEY"),
    Provider("Azure OpenAI", ("openai.azure.com",), re.compile(r"^AZURE_OPENAI_"),
             "AZURE_OPENAI_API_KEY"),
    Provider("Anthropic", ("api.anthropic.com",), re.compile(r"^(ANTHROPIC|CLAUDE)_"),
             "ANTHROPIC_API_KEY"),
    Provider("Google", ("generativelanguage.googleapis.com", "aiplatform.googleapis.com"),
             re.compile(r"^(GOOGLE|GEMINI|VERTEX)_"), "GEMINI_API_KEY"),
    Provider("Together", ("api.together.xyz", "api.together.ai"), re.compile(r"^TOGETHER_"),
             "TOGETHER_API_KEY"),
    Provider("Groq", ("api.groq.com",), re.compile(r"^GROQ_"), "GROQ_API_KEY"),
    Provider("Mistral", ("api.mistral.ai",), re.compile(r"^(MISTRAL|CODESTRAL)_"),
             "MISTRAL_API_KEY"),
    Provider("DeepSeek", ("api.deepseek.com",), re.compile(r"^DEEPSEEK_"), "DEEPSEEK_API_KEY"),
    Provider("OpenRouter", ("openrouter.ai",), re.compile(r"^OPENROUTER_"),
             "OPENROUTER_API_KEY"),
    Provider("Fireworks", ("api.fireworks.ai",), re.compile(r"^FIREWORKS_"),
             "FIREWORKS_API_KEY"),
    Provider("xAI", ("api.x.ai",), re.compile(r"^(XAI|GROK)_"), "XAI_API_KEY"),
    Provider("Cerebras", ("api.cerebras.ai",), re.compile(r"^CEREBRAS_"), "CEREBRAS_API_KEY"),
    Provider("Perplexity", ("api.perplexity.ai",), re.compile(r"^(PERPLEXITY|PPLX)_"),
             "PERPLEXITY_API_KEY"),
    Provider("Hugging Face", ("huggingface.co", "hf.space"), re.compile(r"^(HF|HUGGINGFACE)_"),
             "HF_TOKEN"),
    Provider("NVIDIA", ("api.nvidia.com",), re.compile(r"^(NVIDIA|NGC)_"), "NVIDIA_API_KEY"),
    Provider("DeepInfra", ("api.deepinfra.com",), re.compile(r"^DEEPINFRA_"),
             "DEEPINFRA_API_KEY"),
)


def endpoint(model: ModelConfig) -> str:
    """Returns the URL the model's requests go to."""
    return model.base_url or OPENAI_URL


def display_url(url: str) -> str:
    """Returns a URL without any user:password part, for messages."""
    p = urlparse(url)
    if p.username is None and p.password is None:
        return url
    host = p.hostname or ""
    return p._replace(netloc=host + (f":{p.port}" if p.port else "")).geturl()


def is_local(url: str | None) -> bool:
    """Returns whether an endpoint runs on this machine."""
    return bool(url) and urlparse(url).hostname in _LOCAL_HOSTS


def provider_of_host(url: str) -> Provider | None:
    """Returns the provider whose API a URL points at, or None."""
    host = (urlparse(url).hostname or "").lower()
    return next((p for p in PROVIDERS
                 if any(host == h or host.endswith("." + h) for h in p.hosts)), None)


def provider_of_name(env_name: str) -> Provider | None:
    """Returns the provider a key variable's name claims, or None."""
    return next((p for p in PROVIDERS if p.key_names.match(env_name)), None)


def key_env(model: ModelConfig) -> str | None:
    """Returns the variable the model's key is read from (None: the server takes no key)."""
    if model.api_key_env is not None:
        return model.api_key_env
    provider = provider_of_host(endpoint(model))
    return provider.default_env if provider else None


def check_destination(model: ModelConfig, where: str) -> None:
    """Raises UsageError when the model's key variable names a provider its URL is not."""
    env = key_env(model)
    if env is None or model.allow_key_to_other_host:
        return
    claimed = provider_of_name(env)
    url = endpoint(model)
    if claimed is None or provider_of_host(url) is claimed:
        return
    raise UsageError(f"{where}: api_key_env {env} is a key for {claimed.name}, and base_url "
                     f"{display_url(url)} is not {claimed.name}'s API: the key would be sent "
                     f"there. Name a variable for that server (or none for a keyless one), "
                     f"or set allow_key_to_other_host: true for this model")


def resolve_key(model: ModelConfig, environ: Mapping[str, str], where: str) -> str:
    """Returns the key to send (a placeholder for a keyless server); UsageError if one is
    needed and its variable is unset."""
    check_destination(model, where)
    env = key_env(model)
    if env is None:
        return NO_KEY
    key = environ.get(env, "")
    if key:
        return key
    if is_local(model.base_url):
        return NO_KEY
    raise UsageError(f"{where}: environment variable {env} is not set; it must hold the API "
                     f"key for {display_url(endpoint(model))}")


def check_models(models: tuple[ModelConfig, ...], environ: Mapping[str, str]) -> None:
    """Raises UsageError (one line) for the first model whose key cannot be sent safely."""
    for i, m in enumerate(models):
        resolve_key(m, environ, f"llm.models[{i}] ({m.name})")
