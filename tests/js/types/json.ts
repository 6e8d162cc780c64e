/**
 * Json<T>: the shape T takes once written as JSON. String enums become their string values
 * ("palette-classic" instead of FieldColorModeId.PaletteClassic), so a JSON literal assigned to
 * Json<T> type-checks exactly like the TypeScript object would, excess-property checks
 * included: an unknown or misspelt key is a compile error.
 */
export type Json<T> = T extends string
  ? string extends T
    ? string
    : `${T}`
  : T extends number | boolean | null | undefined
    ? T
    : T extends ReadonlyArray<infer U>
      ? Array<Json<U>>
      : T extends object
        ? { [K in keyof T]: Json<T[K]> }
        : T;
