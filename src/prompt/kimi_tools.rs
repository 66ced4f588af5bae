//! Kimi K2.5's tool declarations: `encode_tools_to_typescript_style` of Moonshot's
//! `tool_declaration_ts.py`, which the model's `tokenization_kimi.py` runs on the tools and
//! passes to the chat template as `tools_ts_str`.
//!
//! Invariants:
//! - The output is byte for byte what Moonshot's Python code returns for the same tools
//!   (`tests/it/kimi_tools.rs` checks it against that code, vendored in
//!   `tests/fixtures/moonshot/`). The tools are taken as `json.loads` gives them to Python,
//!   and every place the Python code raises (a non-string description, an unknown `type` in
//!   a type list, a schema that is neither an object nor a boolean, an unresolvable `$ref`,
//!   …) is an [`EncodeError`] here. The caller then does what `tokenization_kimi.py` does on
//!   any exception: no `tools_ts_str`, so the template falls back to its JSON declaration.
//! - Where the Python code does not raise on odd input, neither does this: a `required`
//!   string counts its characters as names, a scalar `type` that is not a string prints as
//!   Python prints it, `items: false` is `any`, and so on.
//! - Parsing and printing are separate passes, as in the Python classes: a schema error
//!   that only printing would meet (an `additionalProperties` of `1`, an `enum` that is not
//!   a list) does not fail when that part is never printed.

use serde_json::{Map, Value as JsonValue};

use super::python::{json_dumps, json_truthy as truthy, py_str_json};

const INDENT: &str = "  ";
const FIELD_DELIMITER: &str = ",\n";

/// Deeper schemas than this are refused rather than recursed into (rows reach here through
/// serde_json, which refuses JSON nested deeper than 128, so this only guards values built
/// in code).
const MAX_DEPTH: usize = 256;

/// Why Moonshot's encoder would raise on these tools; the template then gets no
/// `tools_ts_str`. The message says what Python would have stumbled on.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("Kimi tool declarations: {0}")]
pub struct EncodeError(String);

fn fail<T>(what: impl Into<String>) -> Result<T, EncodeError> {
    Err(EncodeError(what.into()))
}

/// `encode_tools_to_typescript_style(tools)`: the tools as a TypeScript `namespace
/// functions { … }` block, `""` when there are no function tools, or the error the Python
/// code raises. `tools` is what the template gets as `tools` (after `deep_sort_dict`).
pub fn encode_tools_to_typescript_style(tools: &JsonValue) -> Result<String, EncodeError> {
    if !truthy(tools) {
        return Ok(String::new());
    }
    let mut functions = Vec::new();
    for tool in py_iter(tools)? {
        let tool = as_dict_item(&tool, "a tool")?;
        if tool.get("type").and_then(JsonValue::as_str) != Some("function") {
            // Other tool types (such as "_plugin") are skipped.
            continue;
        }
        let empty = JsonValue::Object(Map::new());
        let function = tool.get("function").unwrap_or(&empty);
        if truthy(function) {
            functions.push(function_to_typescript(function)?);
        }
    }
    if functions.is_empty() {
        return Ok(String::new());
    }
    Ok(format!(
        "# Tools\n\n## functions\nnamespace functions {{\n{}\n}}\n",
        functions.join("\n")
    ))
}

/// `_openai_function_to_typescript_style(function)`.
fn function_to_typescript(function: &JsonValue) -> Result<String, EncodeError> {
    let function = as_dict(function, "a tool's `function`")?;
    let mut registry = Registry::default();
    let empty = JsonValue::Object(Map::new());
    let parameters = function
        .get("parameters")
        .filter(|p| truthy(p))
        .unwrap_or(&empty);
    let parsed = ObjectType::parse(parameters, &mut registry, 0)?;

    let mut interfaces = Vec::new();
    // Decided before the definitions are parsed, as in the Python code.
    let self_referencing = registry.has_self_ref;
    if self_referencing {
        // The root's own property order (not sorted), and no `additionalProperties`.
        let params = parsed
            .properties
            .iter()
            .map(|p| p.to_typescript(INDENT))
            .collect::<Result<Vec<_>, _>>()?
            .join(FIELD_DELIMITER);
        let params = if params.is_empty() {
            params
        } else {
            format!("\n{params}\n")
        };
        interfaces.push(format!("interface parameters {{{params}}}"));
    }
    // A snapshot: definitions registered while parsing these are resolvable but not printed.
    let definitions = registry.definitions.clone();
    for (name, schema) in &definitions {
        let parsed = parse_type(schema, &mut registry, 0)?;
        let body = parsed.to_typescript("")?.into_fstring();
        let schema = as_dict(schema, "a `$defs` entry")?;
        let description = match schema.get("description") {
            Some(d) if truthy(d) => format!("{}\n", format_description(d, "")?),
            _ => String::new(),
        };
        interfaces.push(format!("{description}interface {name} {body}"));
    }

    let name = function
        .get("name")
        .map_or_else(|| "function".to_owned(), py_str_json);
    let type_def = if self_referencing {
        format!("type {name} = (_: parameters) => any;")
    } else {
        format!("type {name} = (_: {}) => any;", parsed.to_typescript("")?)
    };
    let description = match function.get("description") {
        Some(d) if truthy(d) => format_description(d, "")?,
        _ => String::new(),
    };
    Ok([interfaces.join("\n"), description, type_def]
        .into_iter()
        .filter(|part| !part.is_empty())
        .collect::<Vec<_>>()
        .join("\n"))
}

/// `_SchemaRegistry`: the `$defs` seen so far, in first-registration order.
#[derive(Default)]
struct Registry<'a> {
    definitions: Vec<(String, &'a JsonValue)>,
    has_self_ref: bool,
}

/// What `resolve_ref` finds.
enum Resolved<'a> {
    SelfRef,
    Schema(&'a JsonValue),
}

impl<'a> Registry<'a> {
    fn register(&mut self, defs: &'a JsonValue) -> Result<(), EncodeError> {
        if !truthy(defs) {
            return Ok(());
        }
        for (name, schema) in as_dict(defs, "`$defs`")? {
            // A Python dict: a repeated name keeps its first position.
            match self.definitions.iter_mut().find(|(n, _)| n == name) {
                Some(entry) => entry.1 = schema,
                None => self.definitions.push((name.clone(), schema)),
            }
        }
        Ok(())
    }

    fn resolve(&mut self, reference: &JsonValue) -> Result<Resolved<'a>, EncodeError> {
        let Some(reference) = reference.as_str() else {
            return fail(format!(
                "a `$ref` must be a string, not {}",
                py_str_json(reference)
            ));
        };
        if reference == "#" {
            self.has_self_ref = true;
            return Ok(Resolved::SelfRef);
        }
        if !reference.starts_with("#/$defs/") {
            return fail(format!("Unsupported reference format: {reference}"));
        }
        let name = last_segment(reference);
        match self.definitions.iter().find(|(n, _)| n == name) {
            Some((_, schema)) => Ok(Resolved::Schema(schema)),
            None => fail(format!("Reference not found: {reference}")),
        }
    }
}

/// `ref.split("/")[-1]`.
fn last_segment(reference: &str) -> &str {
    reference.rsplit('/').next().unwrap_or(reference)
}

/// `_BaseType`: a schema's description and the constraints its kind prints.
struct Base<'a> {
    description: Option<&'a JsonValue>,
    constraints: Vec<(&'a str, &'a JsonValue)>,
}

impl<'a> Base<'a> {
    fn new(schema: &'a Map<String, JsonValue>, allowed: &[&str]) -> Self {
        Self {
            description: schema.get("description"),
            constraints: schema
                .iter()
                .filter(|(k, _)| allowed.contains(&k.as_str()))
                .map(|(k, v)| (k.as_str(), v))
                .collect(),
        }
    }

    fn empty() -> Self {
        Self {
            description: None,
            constraints: Vec::new(),
        }
    }

    /// `format_docstring(indent)`: `// description` lines, then `// key: value, …`.
    fn docstring(&self, indent: &str) -> Result<String, EncodeError> {
        let mut out = String::new();
        if let Some(description) = self.description.filter(|d| truthy(d)) {
            out.push_str(&format_description(description, indent)?);
            out.push('\n');
        }
        if !self.constraints.is_empty() {
            let mut constraints = self.constraints.clone();
            constraints.sort_by_key(|(k, _)| *k);
            let listed: Vec<String> = constraints
                .iter()
                .map(|(k, v)| format!("{k}: {}", py_str_json(v)))
                .collect();
            out.push_str(&format!("{indent}// {}\n", listed.join(", ")));
        }
        Ok(out)
    }
}

/// `_format_description(description, indent)`: each line commented, empty lines kept empty.
fn format_description(description: &JsonValue, indent: &str) -> Result<String, EncodeError> {
    let Some(description) = description.as_str() else {
        return fail(format!(
            "a description must be a string, not {}",
            py_str_json(description)
        ));
    };
    Ok(description
        .split('\n')
        .map(|line| {
            if line.is_empty() {
                String::new()
            } else {
                format!("{indent}// {line}")
            }
        })
        .collect::<Vec<_>>()
        .join("\n"))
}

/// What `to_typescript_style` returns: a string, except for a scalar whose `type` is not a
/// string, which Python returns as is (f-strings print it, `+` and `join` refuse it).
enum Printed<'a> {
    Text(String),
    Value(&'a JsonValue),
}

impl Printed<'_> {
    /// As an f-string prints it.
    fn into_fstring(self) -> String {
        match self {
            Printed::Text(s) => s,
            Printed::Value(v) => py_str_json(v),
        }
    }

    /// Where Python concatenates or joins it: only strings will do.
    fn into_str(self) -> Result<String, EncodeError> {
        match self {
            Printed::Text(s) => Ok(s),
            Printed::Value(v) => fail(format!(
                "can only concatenate str (not {}) to str",
                py_str_json(v)
            )),
        }
    }
}

impl std::fmt::Display for Printed<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Printed::Text(s) => f.write_str(s),
            Printed::Value(v) => f.write_str(&py_str_json(v)),
        }
    }
}

/// A scalar's `type`: a name the code chose (`any`, `null`) or the schema's own value.
enum ScalarName<'a> {
    Fixed(&'static str),
    Schema(&'a JsonValue),
}

/// The `_ParameterType` classes.
enum ParamType<'a> {
    Scalar {
        base: Base<'a>,
        name: ScalarName<'a>,
    },
    Object(ObjectType<'a>),
    Array {
        base: Base<'a>,
        item: Box<ParamType<'a>>,
    },
    Enum {
        base: Base<'a>,
        values: &'a JsonValue,
    },
    AnyOf {
        base: Base<'a>,
        types: Vec<ParamType<'a>>,
    },
    Union {
        base: Base<'a>,
        types: Vec<&'static str>,
    },
    Ref {
        base: Base<'a>,
        name: String,
    },
}

fn scalar(name: &'static str) -> ParamType<'static> {
    ParamType::Scalar {
        base: Base::empty(),
        name: ScalarName::Fixed(name),
    }
}

/// `_parse_parameter_type(schema, registry)`.
fn parse_type<'a>(
    schema: &'a JsonValue,
    registry: &mut Registry<'a>,
    depth: usize,
) -> Result<ParamType<'a>, EncodeError> {
    if depth > MAX_DEPTH {
        return fail("schema nested too deeply");
    }
    let map = match schema {
        JsonValue::Bool(true) => return Ok(scalar("any")),
        JsonValue::Bool(false) => return Ok(scalar("null")),
        JsonValue::Object(map) => map,
        // Python's `in` tests and `.get` calls fail on every other kind of value.
        other => {
            return fail(format!(
                "Invalid JSON Schema object: {}",
                py_str_json(other)
            ))
        }
    };
    if let Some(reference) = map.get("$ref") {
        let base = Base::new(map, &[]);
        let name = match registry.resolve(reference)? {
            Resolved::SelfRef => "parameters".to_owned(),
            Resolved::Schema(resolved) => {
                let resolved = as_dict(resolved, "a `$ref` target")?;
                if resolved.get("$self_ref").is_some_and(truthy) {
                    "parameters".to_owned()
                } else {
                    // Checked to be a string by `resolve`.
                    last_segment(reference.as_str().unwrap_or_default()).to_owned()
                }
            }
        };
        return Ok(ParamType::Ref { base, name });
    }
    if let Some(alternatives) = map.get("anyOf") {
        let base = Base::new(map, &[]);
        let types = py_iter(alternatives)?
            .into_iter()
            .map(|t| match t {
                Item::Value(v) => parse_type(v, registry, depth + 1),
                Item::Key(k) => fail(format!("Invalid JSON Schema object: {k}")),
            })
            .collect::<Result<_, _>>()?;
        return Ok(ParamType::AnyOf { base, types });
    }
    if let Some(values) = map.get("enum") {
        check_enum(map, values)?;
        return Ok(ParamType::Enum {
            base: Base::new(map, &[]),
            values,
        });
    }
    if let Some(ty) = map.get("type") {
        return match ty {
            JsonValue::Array(names) => {
                let types = names
                    .iter()
                    .map(|name| match name.as_str().and_then(union_member) {
                        Some(t) => Ok(t),
                        None => fail(format!(
                            "unknown type in a type list: {}",
                            py_str_json(name)
                        )),
                    })
                    .collect::<Result<_, _>>()?;
                Ok(ParamType::Union {
                    base: Base::new(map, &[]),
                    types,
                })
            }
            JsonValue::String(s) if s == "object" => Ok(ParamType::Object(ObjectType::parse(
                schema,
                registry,
                depth + 1,
            )?)),
            JsonValue::String(s) if s == "array" => {
                let item = match map.get("items") {
                    Some(items) if truthy(items) => parse_type(items, registry, depth + 1)?,
                    _ => scalar("any"),
                };
                Ok(ParamType::Array {
                    base: Base::new(map, &["minItems", "maxItems"]),
                    item: Box::new(item),
                })
            }
            other => {
                let allowed: &[&str] = match other.as_str() {
                    Some("string") => &["maxLength", "minLength", "pattern"],
                    Some("number" | "integer") => &["maximum", "minimum"],
                    _ => &[],
                };
                Ok(ParamType::Scalar {
                    base: Base::new(map, allowed),
                    name: ScalarName::Schema(other),
                })
            }
        };
    }
    if map.is_empty() {
        return Ok(scalar("any"));
    }
    fail(format!(
        "Invalid JSON Schema object: {}",
        py_str_json(schema)
    ))
}

/// `_ParameterTypeUnion`'s mapping of JSON Schema type names.
fn union_member(name: &str) -> Option<&'static str> {
    Some(match name {
        "string" => "string",
        "number" | "integer" => "number",
        "boolean" => "boolean",
        "null" => "null",
        "object" => "{}",
        "array" => "Array<any>",
        _ => return None,
    })
}

/// `_ParameterTypeEnum.__init__`'s check of the values against a declared `type`.
fn check_enum(map: &Map<String, JsonValue>, values: &JsonValue) -> Result<(), EncodeError> {
    let Some(declared) = map.get("type") else {
        return Ok(());
    };
    let declared = match declared {
        JsonValue::Array(list) => match list.as_slice() {
            [only] => only,
            [a, b] if list.iter().any(|t| t.as_str() == Some("null")) => {
                if a.as_str() != Some("null") {
                    a
                } else {
                    b
                }
            }
            _ => {
                return fail(format!(
                    "Enum type {} is not supported",
                    py_str_json(declared)
                ))
            }
        },
        other => other,
    };
    for value in py_iter(values)? {
        let ok = match (declared.as_str(), value) {
            (_, Item::Value(JsonValue::Null)) => true,
            (Some("string"), Item::Value(v)) => v.is_string(),
            (Some("string"), Item::Key(_)) => true,
            (Some("number"), Item::Value(v)) => v.is_number() || v.is_boolean(),
            (Some("integer"), Item::Value(v)) => v.is_i64() || v.is_u64() || v.is_boolean(),
            (Some("boolean"), Item::Value(v)) => v.is_boolean(),
            (Some("number" | "integer" | "boolean"), Item::Key(_)) => false,
            _ => true,
        };
        if !ok {
            return fail(format!(
                "Enum value does not match its type {}",
                py_str_json(declared)
            ));
        }
    }
    Ok(())
}

/// `_ParameterTypeObject`.
struct ObjectType<'a> {
    base: Base<'a>,
    properties: Vec<Parameter<'a>>,
    additional: Additional<'a>,
}

/// `additionalProperties` as the object keeps it.
enum Additional<'a> {
    Absent,
    Schema(Box<ParamType<'a>>),
    Other(&'a JsonValue),
}

impl<'a> ObjectType<'a> {
    fn parse(
        schema: &'a JsonValue,
        registry: &mut Registry<'a>,
        depth: usize,
    ) -> Result<Self, EncodeError> {
        let map = as_dict(schema, "parameters")?;
        let mut object = Self {
            base: Base::new(map, &[]),
            properties: Vec::new(),
            additional: Additional::Absent,
        };
        if map.is_empty() {
            return Ok(object);
        }
        if let Some(defs) = map.get("$defs") {
            registry.register(defs)?;
        }
        object.additional = match map.get("additionalProperties") {
            None | Some(JsonValue::Null) => Additional::Absent,
            Some(ap @ JsonValue::Object(_)) => {
                Additional::Schema(Box::new(parse_type(ap, registry, depth + 1)?))
            }
            Some(other) => Additional::Other(other),
        };
        let Some(properties) = map.get("properties") else {
            return Ok(object);
        };
        let properties = as_dict(properties, "`properties`")?;
        let required = required_names(map.get("required"))?;
        for (name, prop) in properties {
            let ty = parse_type(prop, registry, depth + 1)?;
            let default = prop.get("default").filter(|d| !d.is_null());
            object.properties.push(Parameter {
                name,
                ty,
                optional: !required.iter().any(|r| r == name),
                default,
            });
        }
        Ok(object)
    }

    fn to_typescript(&self, indent: &str) -> Result<String, EncodeError> {
        let inner = format!("{indent}{INDENT}");
        let mut ordered: Vec<&Parameter> = self.properties.iter().filter(|p| !p.optional).collect();
        ordered.sort_by_key(|p| p.name.as_str());
        let mut optional: Vec<&Parameter> = self.properties.iter().filter(|p| p.optional).collect();
        optional.sort_by_key(|p| p.name.as_str());
        ordered.extend(optional);

        let mut fields = ordered
            .iter()
            .map(|p| p.to_typescript(&inner))
            .collect::<Result<Vec<_>, _>>()?;
        let additional = match &self.additional {
            Additional::Absent => None,
            Additional::Other(JsonValue::Bool(true)) => Some("any".to_owned()),
            Additional::Other(JsonValue::Bool(false)) => Some("never".to_owned()),
            Additional::Schema(t) => Some(t.to_typescript(&inner)?.into_fstring()),
            Additional::Other(other) => {
                return fail(format!(
                    "Unknown additionalProperties: {}",
                    py_str_json(other)
                ))
            }
        };
        if let Some(value) = additional {
            fields.push(format!("{inner}[k: string]: {value}"));
        }
        if fields.is_empty() {
            return Ok("{}".to_owned());
        }
        Ok(format!("{{\n{}\n{indent}}}", fields.join(FIELD_DELIMITER)))
    }
}

/// `set(json_schema_object.get("required", []))`, of which only strings can match a name.
fn required_names(required: Option<&JsonValue>) -> Result<Vec<String>, EncodeError> {
    let Some(required) = required else {
        return Ok(Vec::new());
    };
    let mut names = Vec::new();
    for item in py_iter(required)? {
        match item {
            Item::Key(k) => names.push(k),
            Item::Value(JsonValue::String(s)) => names.push(s.clone()),
            Item::Value(JsonValue::Array(_) | JsonValue::Object(_)) => {
                return fail("unhashable type in `required`")
            }
            Item::Value(_) => {}
        }
    }
    Ok(names)
}

/// `_Parameter`: a property of an object.
struct Parameter<'a> {
    name: &'a String,
    ty: ParamType<'a>,
    optional: bool,
    default: Option<&'a JsonValue>,
}

impl Parameter<'_> {
    fn to_typescript(&self, indent: &str) -> Result<String, EncodeError> {
        let mut out = self.ty.docstring(indent)?;
        if let Some(default) = self.default {
            let shown = match default {
                JsonValue::Number(_) | JsonValue::Bool(_) => py_str_json(default),
                other => json_dumps(other),
            };
            out.push_str(&format!("{indent}// Default: {shown}\n"));
        }
        let mark = if self.optional { "?" } else { "" };
        let ty = self.ty.to_typescript(indent)?;
        out.push_str(&format!("{indent}{}{mark}: {ty}", self.name));
        Ok(out)
    }
}

impl<'a> ParamType<'a> {
    fn base(&self) -> &Base<'a> {
        match self {
            ParamType::Scalar { base, .. }
            | ParamType::Array { base, .. }
            | ParamType::Enum { base, .. }
            | ParamType::AnyOf { base, .. }
            | ParamType::Union { base, .. }
            | ParamType::Ref { base, .. } => base,
            ParamType::Object(object) => &object.base,
        }
    }

    fn docstring(&self, indent: &str) -> Result<String, EncodeError> {
        self.base().docstring(indent)
    }

    /// `to_typescript_style(indent)`.
    fn to_typescript(&self, indent: &str) -> Result<Printed<'a>, EncodeError> {
        Ok(match self {
            ParamType::Scalar { name, .. } => match name {
                ScalarName::Fixed(s) => Printed::Text((*s).to_owned()),
                ScalarName::Schema(JsonValue::String(s)) if s == "integer" => {
                    Printed::Text("number".to_owned())
                }
                ScalarName::Schema(JsonValue::String(s)) => Printed::Text(s.clone()),
                ScalarName::Schema(other) => Printed::Value(other),
            },
            ParamType::Object(object) => Printed::Text(object.to_typescript(indent)?),
            ParamType::Array { item, .. } => {
                let inner = format!("{indent}{INDENT}");
                let doc = item.docstring(&inner)?;
                if doc.is_empty() {
                    Printed::Text(format!("Array<{}>", item.to_typescript(indent)?))
                } else {
                    let item = item.to_typescript(&inner)?.into_str()?;
                    Printed::Text(format!("Array<\n{doc}{inner}{item}\n{indent}>"))
                }
            }
            ParamType::Enum { values, .. } => {
                let shown = py_iter(values)?
                    .into_iter()
                    .map(|v| match v {
                        Item::Key(k) => format!("\"{k}\""),
                        Item::Value(JsonValue::String(s)) => format!("\"{s}\""),
                        Item::Value(other) => py_str_json(other),
                    })
                    .collect::<Vec<_>>();
                Printed::Text(shown.join(" | "))
            }
            ParamType::AnyOf { types, .. } => Printed::Text(
                types
                    .iter()
                    .map(|t| t.to_typescript(indent)?.into_str())
                    .collect::<Result<Vec<_>, _>>()?
                    .join(" | "),
            ),
            ParamType::Union { types, .. } => Printed::Text(types.join(" | ")),
            ParamType::Ref { name, .. } => Printed::Text(name.clone()),
        })
    }
}

/// One item of Python's `for x in value`: a list's element, or a string's character or a
/// dict's key (both strings).
enum Item<'a> {
    Value(&'a JsonValue),
    Key(String),
}

/// Python's iteration of a JSON value: lists give their elements, strings their characters,
/// dicts their keys; other values are not iterable.
fn py_iter(value: &JsonValue) -> Result<Vec<Item<'_>>, EncodeError> {
    match value {
        JsonValue::Array(items) => Ok(items.iter().map(Item::Value).collect()),
        JsonValue::String(s) => Ok(s.chars().map(|c| Item::Key(c.to_string())).collect()),
        JsonValue::Object(map) => Ok(map.keys().map(|k| Item::Key(k.clone())).collect()),
        other => fail(format!("{} is not iterable", py_str_json(other))),
    }
}

/// The value as a dict, where Python would call `.get` on it.
fn as_dict<'a>(
    value: &'a JsonValue,
    what: &str,
) -> Result<&'a Map<String, JsonValue>, EncodeError> {
    match value {
        JsonValue::Object(map) => Ok(map),
        other => fail(format!(
            "{what} must be an object, not {}",
            py_str_json(other)
        )),
    }
}

/// An iterated item as a dict, where Python calls `.get` on it: characters and keys fail.
fn as_dict_item<'a>(
    item: &Item<'a>,
    what: &str,
) -> Result<&'a Map<String, JsonValue>, EncodeError> {
    match item {
        Item::Value(v) => as_dict(v, what),
        Item::Key(k) => fail(format!("{what} must be an object, not '{k}'")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// The outputs Moonshot's own `tool_declaration_ts.py` gave, run from a Kimi-K2.5 model
    /// snapshot by another project (see tests/fixtures/moonshot/SOURCES.md): spool gives the
    /// same bytes for every one.
    #[test]
    fn matches_goldens_from_moonshots_encoder() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/moonshot/encoder-goldens.jsonl");
        let text = std::fs::read_to_string(path).unwrap();
        let mut checked = 0;
        for line in text.lines().filter(|l| !l.trim().is_empty()) {
            let case: JsonValue = serde_json::from_str(line).unwrap();
            let got = encode_tools_to_typescript_style(&case["tools"]).unwrap();
            assert_eq!(got, case["expected"].as_str().unwrap(), "{}", case["id"]);
            checked += 1;
        }
        assert_eq!(checked, 13);
    }

    /// Where Python raises, the encoder fails (the caller then leaves `tools_ts_str` out);
    /// no tools, or none of type `function`, declare nothing.
    #[test]
    fn failures_and_empty_declarations() {
        let schema = |prop: JsonValue| {
            json!([{"type": "function", "function": {"name": "f", "parameters":
                {"type": "object", "properties": {"a": prop}}}}])
        };
        for bad in [
            json!({"description": "no type"}),
            json!({"oneOf": [{"const": "end"}]}),
            json!({"type": ["string", "date"]}),
            json!({"type": "string", "description": 5}),
            json!({"$ref": "#/$defs/Missing"}),
            json!("string"),
        ] {
            assert!(
                encode_tools_to_typescript_style(&schema(bad.clone())).is_err(),
                "{bad}"
            );
        }
        assert_eq!(encode_tools_to_typescript_style(&json!([])).unwrap(), "");
        assert_eq!(
            encode_tools_to_typescript_style(&json!([{"type": "_plugin", "_plugin": {}}])).unwrap(),
            ""
        );
        assert_eq!(
            encode_tools_to_typescript_style(&schema(json!({"type": "integer", "default": 3})))
                .unwrap(),
            "# Tools\n\n## functions\nnamespace functions {\ntype f = (_: {\n  // Default: 3\n  a?: number\n}) => any;\n}\n"
        );
    }
}
