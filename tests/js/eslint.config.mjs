// ESLint for the live page's ES modules (exporter/static/*.js), run by tests/http/test_page.py:
// recommended rules, plus those that catch what a long-lived page gets wrong (a name declared
// twice, one that shadows another, loose equality).
import js from "@eslint/js";
import globals from "globals";

export default [
  js.configs.recommended,
  {
    files: ["**/*.js"],
    languageOptions: {
      ecmaVersion: 2022,
      sourceType: "module",
      globals: { ...globals.browser, uPlot: "readonly" },
    },
    rules: {
      eqeqeq: "error",
      "no-shadow": "error",
      "no-var": "error",
      "prefer-const": "error",
      "no-unused-vars": ["error", { args: "after-used" }],
    },
  },
];
