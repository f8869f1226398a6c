"""An import-linter contract type the project's contracts (pyproject.toml, [tool.importlinter]) use.

``acyclic_modules``: no cycle among the modules of a package, module by module (import-linter's own
``acyclic_siblings`` compares whole subpackages, which would forbid io/ and arch/ importing each
other's modules at all). The graph is grimp's: every import statement in a module's source, those
inside functions and under ``if TYPE_CHECKING`` included, so a loop hidden by a deferred import is
still a loop.

    lint-imports        # from the repository root (make lint; tests/test_import_graph.py runs it)
"""

from __future__ import annotations

from typing import Any

from importlinter import Contract, ContractCheck, fields, output


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return sorted(found)


class AcyclicModulesContract(Contract):
    type_name = "acyclic_modules"
    package = fields.StringField()

    def check(self, graph: Any, verbose: bool) -> ContractCheck:
        package = str(self.package)
        modules = graph.find_descendants(package) | {package}
        edges = {
            m: {n for n in graph.find_modules_directly_imported_by(m) if n in modules and n != m}
            for m in modules
        }
        loops = cycles(edges)
        return ContractCheck(kept=not loops, metadata={"cycles": loops, "edges": edges})

    def render_broken_contract(self, check: ContractCheck) -> None:
        edges = check.metadata["edges"]
        for loop in check.metadata["cycles"]:
            output.print_error(f"{len(loop)} modules import each other in a loop:")
            for m in loop:
                inside = sorted(n for n in edges[m] if n in loop)
                output.print(f"  {m} -> {', '.join(inside)}")
            output.new_line()
