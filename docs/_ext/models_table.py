"""The ``models-table`` directive: the registered models, from the code behind ``timm-layerscale list``.

The table is built when the documentation is built, from
:func:`timm_layerscale.catalog.model_catalog` (every model built on the meta device), so
it cannot drift from the registry.
"""
from __future__ import annotations

from docutils import nodes
from sphinx.util.docutils import SphinxDirective


class ModelsTable(SphinxDirective):
    """``.. models-table::`` renders one row per registered model."""

    has_content = False

    def run(self) -> list[nodes.Node]:
        from timm_layerscale.catalog import model_catalog

        head = ["model", "timm twin", "params (M)", "res.", "init", "pretrained tags"]
        rows = []
        for row in model_catalog():
            tags = ", ".join(t.split(".", 1)[1] for t in row["pretrained"]) or "none released"
            rows.append([
                nodes.literal(text=row["name"]),
                nodes.literal(text=row["reference"]) if row["reference"] != "-" else nodes.Text("-"),
                nodes.Text(f"{row['params'] / 1e6:.1f}"),
                nodes.Text(str(row["resolution"])),
                nodes.Text(f"{row['init_value']:.0e}"),
                nodes.Text(tags),
            ])
        table = nodes.table(classes=["models-table"])
        group = nodes.tgroup(cols=len(head))
        table += group
        group.extend(nodes.colspec(colwidth=1) for _ in head)
        thead = nodes.thead()
        thead += self._row([nodes.Text(h) for h in head])
        group += thead
        tbody = nodes.tbody()
        tbody.extend(self._row(cells) for cells in rows)
        group += tbody
        return [table]

    @staticmethod
    def _row(cells: list[nodes.Node]) -> nodes.row:
        row = nodes.row()
        for cell in cells:
            entry = nodes.entry()
            entry += nodes.paragraph("", "", cell)
            row += entry
        return row


def setup(app):
    app.add_directive("models-table", ModelsTable)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
