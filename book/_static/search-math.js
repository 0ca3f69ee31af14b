/* Search results quote each page's text, where the maths is still TeX source: MathJax
   typesets it only on the page itself. Before Sphinx takes the text for a result's summary,
   each formula becomes plain text (\(\sqrt{x}\cdot y\) -> √(x)·y), so that a summary shows
   no backslashes and no formula cut in half by its delimiters. */
(function () {
  const SYMBOLS = {
    alpha: "α", beta: "β", gamma: "γ", delta: "δ", epsilon: "ε", varepsilon: "ε",
    theta: "θ", lambda: "λ", mu: "μ", pi: "π", rho: "ρ", sigma: "σ", tau: "τ", phi: "φ",
    omega: "ω", Delta: "Δ", Sigma: "Σ", Omega: "Ω", cdot: "·", times: "×", le: "≤",
    leq: "≤", ge: "≥", geq: "≥", ne: "≠", neq: "≠", approx: "≈", in: "∈", sum: "Σ",
    prod: "Π", infty: "∞", pm: "±", to: "→", rightarrow: "→", leftarrow: "←", ldots: "…",
    dots: "…", cdots: "…", lfloor: "⌊", rfloor: "⌋", lceil: "⌈", rceil: "⌉", oplus: "⊕",
    odot: "⊙", otimes: "⊗", mid: "|", lvert: "|", rvert: "|", langle: "⟨", rangle: "⟩",
    ell: "ℓ", partial: "∂", nabla: "∇", cap: "∩", cup: "∪", subset: "⊂", sim: "~",
    propto: "∝", ll: "≪", gg: "≫", equiv: "≡", neg: "¬", forall: "∀", exists: "∃",
  };

  // \mathrm{x}, \text{x} and the like: x
  const FONTS = new RegExp("\\\\(?:mathrm|text|operatorname|mathbf|mathit|mathtt|texttt|" +
                           "mathcal|boldsymbol|hat|bar|tilde|vec|overline)\\{([^{}]*)\\}", "g");

  function texToText(tex) {
    let s = tex.trim().replace(/^\\\(|\\\)$|^\\\[|\\\]$|^\$\$?|\$\$?$/g, "");
    for (let k = 0; k < 3; k++) {  // a few rounds for nested braces
      s = s.replace(FONTS, "$1");
      s = s.replace(/\\frac\{([^{}]*)\}\{([^{}]*)\}/g, "($1)/($2)");
      s = s.replace(/\\sqrt\{([^{}]*)\}/g, "√($1)");
      s = s.replace(/\\(?:underbrace|overbrace)\{([^{}]*)\}(?:_\{[^{}]*\})?/g, "$1");
    }
    s = s.replace(/\\(left|right|big|Big|bigg|Bigg)\b/g, "");
    s = s.replace(/\\[,;:! ]|\\q?quad\b/g, " ");
    s = s.replace(/\\([A-Za-z]+)/g, (m, name) => SYMBOLS[name] ?? name);
    s = s.replace(/\\(.)/g, "$1").replace(/[{}]/g, "");
    return s.replace(/\s+/g, " ").trim();
  }

  function patch() {
    if (typeof Search === "undefined" || Search._mathAsText) return;
    const htmlToText = Search.htmlToText;
    Search.htmlToText = (htmlString, anchor) => {
      const doc = new DOMParser().parseFromString(htmlString, "text/html");
      doc.querySelectorAll(".math").forEach((el) => {
        el.textContent = " " + texToText(el.textContent) + " ";
      });
      return htmlToText(doc.documentElement.outerHTML, anchor);
    };
    Search._mathAsText = true;
  }

  // searchtools.js comes after this file on the search page; its own start-up waits for
  // the document too, and runs after this handler
  if (typeof document !== "undefined") document.addEventListener("DOMContentLoaded", patch);
  // for tests/test_rendering.py, under node
  if (typeof module !== "undefined") module.exports = { texToText };
})();
