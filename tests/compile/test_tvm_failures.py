"""An exception from outside Kiln — a check that failed in TVM, a library's KeyError — reaches the
user as one line naming where it happened: the build stage, or the model's step at run time."""

from __future__ import annotations

import pytest
from tvm.relax.frontend.nn.llm import _kernel_common

from helpers.failures import assert_clean_failure

from kiln.compile.pipeline import StageClock
from kiln.errors import KilnError
from kiln.models.kv_cache import kernel_memo
from kiln.runtime import SEQUENCE_ID, NativeModel


def test_an_exception_in_a_build_stage_is_one_line_naming_the_stage():
    clock = StageClock()
    with pytest.raises(KilnError, match=r"^the compile cpu stage failed: KeyError: 'beta_fast'$") as failure:
        with clock.stage("compile cpu"):
            raise KeyError("beta_fast")
    assert isinstance(failure.value.__cause__, KeyError)  # --debug shows its traceback


def test_a_kiln_error_in_a_build_stage_passes_through_unchanged():
    with pytest.raises(KilnError, match=r"^config.json: broken$"):
        with StageClock().stage("ingest"):
            raise KilnError("broken", "config.json")


def test_an_exception_tvm_raises_while_it_writes_a_kernel_is_one_line_naming_the_stage(
    tiny_source, tmp_path, run_compile, monkeypatch
):
    """TVMScript's parser reports it as a DiagnosticError quoting the kernel's source: the line names
    the exception itself, as TVM's YaRN kernel raised it for a config.json without the betas."""

    def rope_without_betas(rope_scaling):
        raise KeyError("beta_fast")

    monkeypatch.setattr(_kernel_common, "switch_rope_freq_func", rope_without_betas)
    monkeypatch.setattr(kernel_memo, "_made", {})  # kernels made earlier in this process are not parsed again
    result = run_compile(tiny_source, tmp_path / "out")
    assert_clean_failure(result, tmp_path / "out")
    assert result.stderr.strip().splitlines()[-1] == "kiln: error: the compile cpu stage failed: KeyError: 'beta_fast'"


@pytest.mark.parametrize("tokens", [[5, 6, 7], [5]], ids=["prefill", "decode"])
def test_a_check_that_fails_in_tvms_runtime_is_a_kiln_error_naming_the_step(tiny_build, tokens):
    model = NativeModel(tiny_build("q4f32_1"))
    model._kv_builtin["kv_state_remove_sequence"](model.kv_cache, SEQUENCE_ID)  # the step's sequence is gone
    step = "prefill" if len(tokens) > 1 else "decode"
    with pytest.raises(KilnError, match=rf"the model's {step} step failed in TVM: .*cannot be found") as failure:
        model.prefill(tokens)
    assert str(failure.value).startswith(str(model.model_dir))
