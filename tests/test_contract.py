"""The method contract (`mmspec.testing.contract`) over every (family, method) pair the family records list, each
family run by its case in `contract_cases.py`: exactness against vanilla (and the model library's own decoding),
seeds that fix the output, the lossless methods' sampled law with a negative control, and one-line refusals of
parameters a method does not take."""

from __future__ import annotations

import pytest
from contract_cases import CASES

from mmspec.families import available_families, get_family
from mmspec.testing import contract
from mmspec.testing.contract import contract_pairs, law_given

_PIPES: dict = {}


def pipe_of(family: str):
    """The family's tiny pipeline, built once per session (cases share it across the checks)."""
    if family not in _PIPES:
        _PIPES[family] = CASES[family].build()
    return _PIPES[family]


def test_every_installed_family_has_a_case_and_every_method_is_checked():
    assert set(CASES) == set(available_families())
    pairs = contract_pairs(CASES)
    assert len(pairs) == sum(len(get_family(f).methods) for f in CASES) >= 36


@pytest.mark.parametrize("family, method", contract_pairs(CASES))
def test_exact_settings_give_vanillas_tokens(family, method):
    contract.check_exact(CASES[family], pipe_of(family), method)


@pytest.mark.parametrize("family, method", contract_pairs(
    CASES, lambda case, record: record.name != "vanilla" and record.seed_fixes_output({}, 1.0)))
def test_a_seed_fixes_the_output_where_the_record_says_so(family, method):
    contract.check_seed_fixes_output(CASES[family], pipe_of(family), method)


@pytest.mark.parametrize("family, method", contract_pairs(
    CASES, lambda case, record: type(case).probs_at is not contract.ContractCase.probs_at
    and record.is_lossless(law_given(record))))
def test_lossless_methods_sample_the_targets_law(family, method):
    contract.check_law(CASES[family], pipe_of(family), method)


@pytest.mark.parametrize("family, method", contract_pairs(CASES))
def test_a_parameter_the_method_does_not_take_is_a_one_line_error(family, method):
    contract.check_bad_parameters(CASES[family], pipe_of(family), method)


@pytest.mark.parametrize("family", [f for f in sorted(CASES)
                                    if type(CASES[f]).library_greedy is not contract.ContractCase.library_greedy])
def test_greedy_vanilla_equals_the_reference_decoding(family):
    contract.check_library(CASES[family], pipe_of(family))


class BentToyCase(type(CASES["toy"])):
    """The toy case with a bent sampler (temperature 0.7 where 1 was asked) and, for draft-model, a changed token."""

    def run(self, models, method, given, conditions, *, temperature, seed=0, budget=None, law=False):
        out = super().run(models, method, given, conditions, temperature=0.7 if temperature == 1 else temperature,
                          seed=seed, budget=budget, law=law)
        if method == "draft-model":
            out.tokens[0][-1] = (out.tokens[0][-1] + 1) % 16
        return out


def test_the_checks_fail_a_bent_sampler_and_a_changed_token():
    case = BentToyCase()
    with pytest.raises(AssertionError):
        contract.check_law(case, pipe_of("toy"), "vanilla")
    with pytest.raises(AssertionError):
        contract.check_exact(case, pipe_of("toy"), "draft-model")
    contract.check_exact(case, pipe_of("toy"), "tree")  # the untouched method still passes
